//! Hostile-layer corpus for the root integration tests (also compiled into
//! the executor's `oci` unit tests through `#[path]`, which prove every case
//! is refused without root).
//!
//! Owns: a raw ustar/PAX writer that can express what `tar::Builder` refuses
//! (`..`, absolute names, device nodes, NUL bytes, truncation), an OCI layout
//! writer with correct digests, and the list of layers Strata must refuse
//! without changing anything on the host. Depends only on crates both the
//! executor and the tests crate have (flate2, sha2, hex, serde_json, nix).
#![allow(dead_code)]

use std::fs;
use std::io::Write;
use std::path::Path;

use flate2::write::GzEncoder;
use sha2::{Digest as _, Sha256};

/// Media types written by `write_layout`.
pub const LAYER_TAR: &str = "application/vnd.oci.image.layer.v1.tar";
pub const LAYER_GZIP: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
/// mtime written into every header unless an entry sets its own.
pub const MTIME: u64 = 1_700_000_000;

// --- raw tar writer ---

/// One tar entry, described byte for byte.
#[derive(Debug, Clone)]
pub struct Entry {
    pub path: Vec<u8>,
    /// ustar type flag: b'0' file, b'1' hard link, b'2' symlink, b'3' char,
    /// b'4' block, b'5' directory, b'6' fifo.
    pub kind: u8,
    pub mode: u32,
    pub uid: u64,
    pub gid: u64,
    pub mtime: u64,
    pub link: Vec<u8>,
    pub data: Vec<u8>,
    pub dev: (u32, u32),
    /// Extra PAX records (`SCHILY.xattr.user.x`, `mtime`, ...).
    pub pax: Vec<(String, Vec<u8>)>,
}

impl Entry {
    /// An entry of `kind` at `path` owned by the current euid/egid.
    pub fn new(kind: u8, path: impl AsRef<[u8]>) -> Self {
        let mode = match kind {
            b'5' => 0o755,
            b'2' => 0o777,
            _ => 0o644,
        };
        Entry {
            path: path.as_ref().to_vec(),
            kind,
            mode,
            uid: u64::from(nix::unistd::geteuid().as_raw()),
            gid: u64::from(nix::unistd::getegid().as_raw()),
            mtime: MTIME,
            link: Vec::new(),
            data: Vec::new(),
            dev: (0, 0),
            pax: Vec::new(),
        }
    }
}

/// Builds a tar stream entry by entry, with no safety checks at all.
#[derive(Debug, Default)]
pub struct TarBuilder {
    out: Vec<u8>,
}

impl TarBuilder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends `e`; names or link targets over 100 bytes, and any extra
    /// records, go into a PAX header before it.
    pub fn entry(&mut self, e: Entry) -> &mut Self {
        let mut pax = e.pax.clone();
        if e.path.len() > 100 || e.path.contains(&0) {
            pax.push(("path".into(), e.path.clone()));
        }
        if e.link.len() > 100 {
            pax.push(("linkpath".into(), e.link.clone()));
        }
        if !pax.is_empty() {
            let mut body = Vec::new();
            for (k, v) in &pax {
                body.extend(pax_record(k, v));
            }
            let mut x = Entry::new(b'x', "PaxHeaders/entry");
            x.data = body;
            self.raw_entry(&x);
        }
        self.raw_entry(&e)
    }

    fn raw_entry(&mut self, e: &Entry) -> &mut Self {
        self.out.extend(header(e, e.data.len() as u64));
        self.out.extend(&e.data);
        pad(&mut self.out);
        self
    }

    /// Appends a header declaring `size` data bytes, and no data.
    pub fn header_only(&mut self, e: &Entry, size: u64) -> &mut Self {
        self.out.extend(header(e, size));
        self
    }

    /// Appends raw bytes.
    pub fn raw(&mut self, bytes: &[u8]) -> &mut Self {
        self.out.extend(bytes);
        self
    }

    pub fn file(&mut self, path: &str, data: &[u8]) -> &mut Self {
        let mut e = Entry::new(b'0', path);
        e.data = data.to_vec();
        self.entry(e)
    }

    pub fn file_mode(&mut self, path: &str, data: &[u8], mode: u32) -> &mut Self {
        let mut e = Entry::new(b'0', path);
        e.data = data.to_vec();
        e.mode = mode;
        self.entry(e)
    }

    pub fn dir(&mut self, path: &str) -> &mut Self {
        self.entry(Entry::new(b'5', path))
    }

    pub fn dir_mode(&mut self, path: &str, mode: u32) -> &mut Self {
        let mut e = Entry::new(b'5', path);
        e.mode = mode;
        self.entry(e)
    }

    pub fn symlink(&mut self, path: &str, target: &str) -> &mut Self {
        let mut e = Entry::new(b'2', path);
        e.link = target.as_bytes().to_vec();
        self.entry(e)
    }

    pub fn hardlink(&mut self, path: &str, target: &str) -> &mut Self {
        let mut e = Entry::new(b'1', path);
        e.link = target.as_bytes().to_vec();
        self.entry(e)
    }

    pub fn fifo(&mut self, path: &str) -> &mut Self {
        self.entry(Entry::new(b'6', path))
    }

    pub fn char_dev(&mut self, path: &str, major: u32, minor: u32) -> &mut Self {
        let mut e = Entry::new(b'3', path);
        e.dev = (major, minor);
        self.entry(e)
    }

    pub fn block_dev(&mut self, path: &str, major: u32, minor: u32) -> &mut Self {
        let mut e = Entry::new(b'4', path);
        e.dev = (major, minor);
        self.entry(e)
    }

    /// The stream so far, without the end-of-archive blocks.
    pub fn bytes(&self) -> Vec<u8> {
        self.out.clone()
    }

    /// The stream with the two zero blocks that end an archive.
    pub fn finish(&mut self) -> Vec<u8> {
        let mut out = std::mem::take(&mut self.out);
        out.extend([0u8; 1024]);
        out
    }
}

/// One PAX record: `<len> <key>=<value>\n`, where `len` counts itself.
fn pax_record(key: &str, value: &[u8]) -> Vec<u8> {
    let base = key.len() + value.len() + 3;
    let mut len = base + 1;
    while base + len.to_string().len() != len {
        len = base + len.to_string().len();
    }
    let mut r = format!("{len} {key}=").into_bytes();
    r.extend(value);
    r.push(b'\n');
    r
}

fn octal(field: &mut [u8], v: u64) {
    let digits = field.len() - 1;
    let s = format!("{v:0digits$o}");
    assert!(s.len() <= digits, "{v} does not fit a {digits}-digit tar field");
    field[..digits].copy_from_slice(s.as_bytes());
    field[digits] = 0;
}

/// A ustar header block with a correct checksum.
fn header(e: &Entry, size: u64) -> [u8; 512] {
    let mut h = [0u8; 512];
    let name = &e.path[..e.path.len().min(100)];
    // A NUL in the name goes only through PAX; the ustar name stops before it.
    let name = &name[..name.iter().position(|b| *b == 0).unwrap_or(name.len())];
    h[..name.len()].copy_from_slice(name);
    octal(&mut h[100..108], u64::from(e.mode));
    octal(&mut h[108..116], e.uid);
    octal(&mut h[116..124], e.gid);
    octal(&mut h[124..136], size);
    octal(&mut h[136..148], e.mtime);
    h[156] = e.kind;
    let link = &e.link[..e.link.len().min(100)];
    h[157..157 + link.len()].copy_from_slice(link);
    h[257..263].copy_from_slice(b"ustar\0");
    h[263..265].copy_from_slice(b"00");
    octal(&mut h[329..337], u64::from(e.dev.0));
    octal(&mut h[337..345], u64::from(e.dev.1));
    h[148..156].copy_from_slice(b"        ");
    let sum: u64 = h.iter().map(|b| u64::from(*b)).sum();
    h[148..155].copy_from_slice(format!("{sum:06o}\0").as_bytes());
    h
}

fn pad(out: &mut Vec<u8>) {
    let rem = out.len() % 512;
    if rem != 0 {
        out.resize(out.len() + 512 - rem, 0);
    }
}

// --- OCI layout writer ---

/// `sha256:<hex>` of `bytes`.
pub fn sha256(bytes: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(bytes)))
}

pub fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut enc = GzEncoder::new(Vec::new(), flate2::Compression::default());
    enc.write_all(bytes).expect("gzip into memory");
    enc.finish().expect("gzip into memory")
}

/// Writes `bytes` to `blobs/sha256/<hex>` under `dir`; returns its digest.
pub fn write_blob(dir: &Path, bytes: &[u8]) -> String {
    let digest = sha256(bytes);
    let blobs = dir.join("blobs/sha256");
    fs::create_dir_all(&blobs).expect("create blobs/sha256");
    fs::write(blobs.join(&digest[7..]), bytes).expect("write blob");
    digest
}

/// One layer as it will be written: blob bytes, media type and the diff_id
/// the config will claim.
#[derive(Debug, Clone)]
pub struct LayerBlob {
    pub blob: Vec<u8>,
    pub media_type: &'static str,
    pub diff_id: String,
}

impl LayerBlob {
    /// A correct layer for the uncompressed tar `tar`.
    pub fn new(tar: &[u8], compress: bool) -> Self {
        LayerBlob {
            blob: if compress { gzip(tar) } else { tar.to_vec() },
            media_type: if compress { LAYER_GZIP } else { LAYER_TAR },
            diff_id: sha256(tar),
        }
    }
}

/// Digests of what `write_layout*` wrote.
#[derive(Debug, Clone)]
pub struct WrittenLayout {
    pub manifest: String,
    pub config: String,
    pub blobs: Vec<String>,
    pub diff_ids: Vec<String>,
}

/// Writes a complete OCI layout (oci-layout, index.json tagged `latest`,
/// manifest, config, blobs) for raw tar layers, gzipped when `compress`.
pub fn write_layout(dir: &Path, layers: &[Vec<u8>], compress: bool) -> WrittenLayout {
    let blobs: Vec<LayerBlob> = layers.iter().map(|t| LayerBlob::new(t, compress)).collect();
    write_layout_blobs(dir, &blobs)
}

/// Writes a layout for prepared layer blobs, which may lie.
pub fn write_layout_blobs(dir: &Path, layers: &[LayerBlob]) -> WrittenLayout {
    use serde_json::json;
    let arch = match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    };
    let blobs: Vec<String> = layers.iter().map(|l| write_blob(dir, &l.blob)).collect();
    let diff_ids: Vec<String> = layers.iter().map(|l| l.diff_id.clone()).collect();
    let config = json!({
        "architecture": arch,
        "os": "linux",
        "config": {"Env": ["PATH=/usr/bin:/bin"], "Cmd": ["/bin/sh"], "WorkingDir": "/work"},
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
    })
    .to_string()
    .into_bytes();
    let config_digest = write_blob(dir, &config);
    let layer_descs: Vec<_> = layers
        .iter()
        .zip(&blobs)
        .map(|(l, d)| json!({"mediaType": l.media_type, "digest": d, "size": l.blob.len()}))
        .collect();
    let manifest = json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": config_digest, "size": config.len()},
        "layers": layer_descs,
    })
    .to_string()
    .into_bytes();
    let manifest_digest = write_blob(dir, &manifest);
    let index = json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json",
                       "digest": manifest_digest, "size": manifest.len(),
                       "annotations": {"org.opencontainers.image.ref.name": "latest"}}],
    });
    fs::write(dir.join("oci-layout"), r#"{"imageLayoutVersion":"1.0.0"}"#).expect("write oci-layout");
    fs::write(dir.join("index.json"), index.to_string()).expect("write index.json");
    WrittenLayout { manifest: manifest_digest, config: config_digest, blobs, diff_ids }
}

/// A small valid layer used by the broken-layout cases.
pub fn small_layer() -> Vec<u8> {
    TarBuilder::new().dir("etc").file("etc/hostname", b"corpus\n").finish()
}

/// A layout whose layer blob no longer matches its digest: one byte of the
/// stored blob is flipped after writing (same size, so only the hash tells).
pub fn corrupt_digest_layout(dir: &Path) -> WrittenLayout {
    let written = write_layout(dir, &[small_layer()], true);
    let path = dir.join("blobs/sha256").join(&written.blobs[0][7..]);
    let mut blob = fs::read(&path).expect("read blob");
    let mid = blob.len() / 2;
    blob[mid] ^= 0xff;
    fs::write(&path, blob).expect("rewrite blob");
    written
}

/// A layout whose gzip layer is corrupt but correctly digested: the first
/// deflate block header is set to the reserved block type, which any inflater
/// rejects at once.
pub fn corrupt_gzip_layout(dir: &Path) -> WrittenLayout {
    let mut layer = LayerBlob::new(&small_layer(), true);
    // 10-byte gzip header (no optional fields from GzEncoder), then deflate.
    layer.blob[10] = 0xff;
    write_layout_blobs(dir, &[layer])
}

/// A layout whose config claims a diff_id the layer does not have.
pub fn diff_id_mismatch_layout(dir: &Path) -> WrittenLayout {
    let mut layer = LayerBlob::new(&small_layer(), true);
    layer.diff_id = sha256(b"not this layer");
    write_layout_blobs(dir, &[layer])
}

/// A broken layout: name, writer, fragment of the expected error message.
pub type LayoutCase = (&'static str, fn(&Path) -> WrittenLayout, &'static str);

/// Broken layouts, by name, with a fragment of the expected error message.
pub fn layout_cases() -> Vec<LayoutCase> {
    vec![
        ("corrupt-gzip", corrupt_gzip_layout, "corrupt gzip stream"),
        ("blob-digest-mismatch", corrupt_digest_layout, "blob hashes to"),
        ("diff-id-mismatch", diff_id_mismatch_layout, "the diff_id is"),
    ]
}

// --- hostile layers ---

/// A host path unique to this process, e.g. `/tmp/strata-escape-42-abs`.
fn escape_path(tag: &str) -> &'static str {
    Box::leak(format!("/tmp/strata-escape-{}-{tag}", std::process::id()).into_boxed_str())
}

/// Enough `../` to reach `/` from any destination depth.
fn climb() -> String {
    "../".repeat(24)
}

/// A hostile case: name, layers (uncompressed tars, bottom first), and a host
/// path that must not exist afterwards.
pub type HostileCase = (&'static str, Vec<Vec<u8>>, Option<&'static str>);

/// Hostile layers: (name, layers, host path that must NOT exist afterwards).
/// Each must be refused with a clear error; `expected_message(name)` gives a
/// fragment of it. Host paths are under /tmp and unique to this process.
pub fn hostile_cases() -> Vec<HostileCase> {
    let p_dotdot = escape_path("dotdot");
    let p_inner = escape_path("dotdot-inner");
    let p_abs = escape_path("abs");
    let p_through = escape_path("through");
    let p_nested = escape_path("nested");
    let p_swap = escape_path("swap");
    let p_relsym = escape_path("relsym");
    let name = |p: &str| p.trim_start_matches("/tmp/").to_owned();

    let mut truncated = TarBuilder::new();
    truncated.dir("a").file("a/big", &[b'x'; 4096]);
    let mut truncated = truncated.bytes();
    // Headers of "a" and "a/big" are 1024 bytes; cut 1000 bytes into the data.
    truncated.truncate(1024 + 1000);

    let mut huge_pax = Entry::new(b'0', "huge");
    huge_pax.pax = vec![("comment".into(), vec![b'x'; 2 << 20])];

    let mut trusted = Entry::new(b'5', "d");
    trusted.pax = vec![("SCHILY.xattr.trusted.overlay.opaque".into(), b"y".to_vec())];

    vec![
        (
            "dotdot-path",
            vec![TarBuilder::new().file(&format!("{}{}", climb(), &p_dotdot[1..]), b"pwned").finish()],
            Some(p_dotdot),
        ),
        (
            "dotdot-inside-path",
            vec![TarBuilder::new().dir("a").file(&format!("a/{}{}", climb(), &p_inner[1..]), b"pwned").finish()],
            Some(p_inner),
        ),
        ("absolute-path", vec![TarBuilder::new().file(p_abs, b"pwned").finish()], Some(p_abs)),
        (
            "symlink-then-write-through",
            vec![TarBuilder::new()
                .symlink("evil", "/tmp")
                .file(&format!("evil/{}", name(p_through)), b"pwned")
                .finish()],
            Some(p_through),
        ),
        (
            "nested-symlink-then-write-through",
            vec![TarBuilder::new()
                .dir("a")
                .symlink("a/b", "/tmp")
                .file(&format!("a/b/{}", name(p_nested)), b"pwned")
                .finish()],
            Some(p_nested),
        ),
        (
            "dir-replaced-by-symlink-then-write-through",
            vec![TarBuilder::new()
                .dir("d")
                .symlink("d", "/tmp")
                .file(&format!("d/{}", name(p_swap)), b"pwned")
                .finish()],
            Some(p_swap),
        ),
        (
            "relative-symlink-escape",
            vec![TarBuilder::new()
                .symlink("up", &format!("{}tmp", climb()))
                .file(&format!("up/{}", name(p_relsym)), b"pwned")
                .finish()],
            Some(p_relsym),
        ),
        ("hardlink-dotdot", vec![TarBuilder::new().hardlink("passwd", "../../etc/passwd").finish()], None),
        ("hardlink-absolute", vec![TarBuilder::new().hardlink("passwd", "/etc/passwd").finish()], None),
        (
            "hardlink-through-symlink",
            vec![TarBuilder::new().symlink("etc", "/etc").hardlink("passwd", "etc/passwd").finish()],
            None,
        ),
        ("char-device", vec![TarBuilder::new().char_dev("mem", 1, 1).finish()], None),
        ("block-device", vec![TarBuilder::new().block_dev("sda", 8, 0).finish()], None),
        ("truncated-tar", vec![truncated], None),
        ("trusted-xattr", vec![TarBuilder::new().entry(trusted).finish()], None),
        ("whiteout-dotdot", vec![TarBuilder::new().file(".wh..", b"").finish()], None),
        ("whiteout-empty-name", vec![TarBuilder::new().file("a/.wh.", b"").finish()], None),
        ("nul-in-name", vec![TarBuilder::new().file("a\0b", b"x").finish()], None),
        ("name-too-long", vec![TarBuilder::new().file(&"n".repeat(300), b"x").finish()], None),
        ("path-too-long", vec![TarBuilder::new().file(&[&"p".repeat(200)[..]; 25].join("/"), b"x").finish()], None),
        ("too-deep", vec![TarBuilder::new().file(&format!("{}f", "d/".repeat(600)), b"x").finish()], None),
        ("huge-pax-header", vec![TarBuilder::new().entry(huge_pax).finish()], None),
    ]
}

/// A fragment of the error message each hostile case must produce.
pub fn expected_message(case: &str) -> &'static str {
    match case {
        "dotdot-path" | "dotdot-inside-path" | "relative-symlink-escape" | "hardlink-dotdot" | "hardlink-absolute" => {
            "escapes the layer root"
        }
        "absolute-path" => "absolute path",
        "symlink-then-write-through"
        | "nested-symlink-then-write-through"
        | "dir-replaced-by-symlink-then-write-through"
        | "hardlink-through-symlink" => "passes through symlink",
        "char-device" | "block-device" => "device node",
        "truncated-tar" => "truncated",
        "trusted-xattr" => "trusted namespace",
        "whiteout-dotdot" | "whiteout-empty-name" => "not a valid whiteout",
        "nul-in-name" => "NUL byte",
        "name-too-long" | "path-too-long" => "longer than",
        "too-deep" => "deeper than 512",
        "huge-pax-header" => "exceed",
        _ => "",
    }
}
