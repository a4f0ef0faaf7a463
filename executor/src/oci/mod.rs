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
