//! OCI image input: read an image layout or archive (`layout`) and unpack its
//! layer tars safely into directories that become overlay lowers (`unpack`).
//!
//! Owns: descriptor and digest validation, the whiteout conversion from the
//! OCI tar form to the overlay form, and every check that keeps a hostile
//! layer inside its destination directory. Does not own: where layers live on
//! disk, the database, pulling from registries, or the reverse direction
//! (upper dir → tar), which belongs to `diff`.

pub mod digest;
pub mod layout;
mod meter;
pub(crate) mod sys;
mod tarpath;
pub mod unpack;

pub use digest::{Digest, DigestError};
pub use layout::{open, Compression, ImageConfig, ImageSource, LayerSource, LayoutError};
pub use sys::read_in_tree;
pub use tarpath::{PathError, MAX_DEPTH};
pub use unpack::{
    unpack_capture, unpack_layer, unpack_own_stream, unpack_own_tar, LayerName, UnpackError, UnpackStats,
};

/// `v` as JSON bytes that are the same for the same document: oci-spec keeps
/// labels and annotations in `HashMap`s, whose order differs from one map
/// to the next, and a config or manifest written twice must hash the same
/// (a second push sends nothing). Going through `serde_json::Value` sorts
/// every object's keys (its map is a `BTreeMap`: serde_json's
/// `preserve_order` is off).
pub fn canonical_json<T: serde::Serialize>(v: &T) -> serde_json::Result<Vec<u8>> {
    serde_json::to_vec(&serde_json::to_value(v)?)
}

/// A descriptor of the blob `digest`, `size` bytes of `media_type`.
pub fn descriptor(media_type: &str, digest: &Digest, size: u64) -> oci_spec::image::Descriptor {
    oci_spec::image::Descriptor::new(media_type.into(), size, digest)
}

/// An OCI image manifest (schema 2) of `config` and `layers`.
pub fn image_manifest(
    config: oci_spec::image::Descriptor,
    layers: Vec<oci_spec::image::Descriptor>,
) -> oci_spec::image::ImageManifest {
    oci_spec::image::ImageManifestBuilder::default()
        .schema_version(oci_spec::image::SCHEMA_VERSION)
        .media_type(oci_spec::image::MediaType::ImageManifest)
        .config(config)
        .layers(layers)
        .build()
        // The builder fails only on a required field left unset; all are set.
        .expect("schema version, config and layers are set")
}

/// The hostile-layer corpus of the root integration tests, compiled into the
/// unit tests too so that every case is proven to be refused without root.
#[cfg(test)]
#[path = "../../../tests/support/corpus.rs"]
pub(crate) mod corpus;

#[cfg(test)]
mod canonical_tests {
    #[test]
    fn a_document_with_labels_serialises_the_same_every_time() {
        // Twenty labels: two HashMaps (two random seeds) almost never list
        // them in the same order, so plain serde_json::to_vec would differ.
        let labels = |rev: bool| {
            let mut keys: Vec<String> = (0..20).map(|i| format!("label.{i:02}")).collect();
            if rev {
                keys.reverse();
            }
            keys.into_iter().map(|k| (k.clone(), k)).collect::<std::collections::HashMap<_, _>>()
        };
        let doc = |rev| {
            let mut cfg = oci_spec::image::Config::default();
            cfg.set_labels(Some(labels(rev)));
            let mut c = oci_spec::image::ImageConfiguration::default();
            c.set_config(Some(cfg));
            c
        };
        let (a, b) = (super::canonical_json(&doc(false)).unwrap(), super::canonical_json(&doc(true)).unwrap());
        assert_eq!(a, b);
        let text = String::from_utf8(a).unwrap();
        let at = |k: &str| text.find(k).unwrap();
        assert!(at("label.00") < at("label.01") && at("label.18") < at("label.19"), "{text}");
    }
}
