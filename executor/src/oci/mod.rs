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

/// The hostile-layer corpus of the root integration tests, compiled into the
/// unit tests too so that every case is proven to be refused without root.
#[cfg(test)]
#[path = "../../../tests/support/corpus.rs"]
pub(crate) mod corpus;
