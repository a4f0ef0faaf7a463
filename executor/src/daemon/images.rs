//! Image verbs: import an OCI layout, list, look up and remove images.

use std::path::PathBuf;

use crate::catalog::DbError;
use crate::error::{Classify, ErrorKind};
use crate::ids::ImageName;
use crate::image;
use crate::types::ImageInfo;

use super::lookup::image_info;
use super::{lock, CollectError, Daemon};

/// Why `import_image` failed.
#[derive(Debug, thiserror::Error, displaydoc::Display)]
pub enum ImportError {
    /// {0}
    Name(#[from] crate::ids::BadImageName),
    /// path must be absolute (it is read by the daemon)
    Relative,
    /// {0} does not exist
    Missing(String),
    /// {0}
    Import(#[from] image::ImageError),
}

impl Classify for ImportError {
    fn kind(&self) -> ErrorKind {
        match self {
            ImportError::Name(_) | ImportError::Relative | ImportError::Missing(_) => ErrorKind::InvalidArgument,
            ImportError::Import(e) => e.kind(),
        }
    }
}

/// Why `get_image` or `remove_image` failed.
#[derive(Debug, thiserror::Error, displaydoc::Display)]
pub enum ImageOpError {
    /// {0}
    Name(#[from] crate::ids::BadImageName),
    /// image {0} not found
    NotFound(ImageName),
    /// {0}
    Image(#[from] image::ImageError),
    /// {0}
    Db(#[from] DbError),
    /// {0}
    Collect(#[from] CollectError),
}

impl Classify for ImageOpError {
    fn kind(&self) -> ErrorKind {
        match self {
            ImageOpError::Name(_) => ErrorKind::InvalidArgument,
            ImageOpError::NotFound(_) => ErrorKind::NotFound,
            ImageOpError::Image(e) => e.kind(),
            ImageOpError::Db(e) => e.kind(),
            ImageOpError::Collect(e) => e.kind(),
        }
    }
}

impl Daemon {
    pub fn import_image(&self, path: &str, tag: Option<&str>, name: &str) -> Result<ImageInfo, ImportError> {
        let name: ImageName = name.parse()?;
        let path = PathBuf::from(path);
        if !path.is_absolute() {
            return Err(ImportError::Relative);
        }
        if !path.exists() {
            return Err(ImportError::Missing(path.display().to_string()));
        }
        let _serial = lock(&self.import_lock);
        let row = self.leased(|lease| image::import(&self.rt.store, &self.db, &path, tag, &name, lease))?;
        Ok(image_info(&row))
    }

    pub fn list_images(&self) -> Result<Vec<ImageInfo>, DbError> {
        Ok(lock(&self.db).list_images()?.iter().map(image_info).collect())
    }

    pub fn get_image(&self, name: &str) -> Result<ImageInfo, ImageOpError> {
        let name: ImageName = name.parse()?;
        let row = lock(&self.db).image_by_name(&name)?;
        row.map(|r| image_info(&r)).ok_or(ImageOpError::NotFound(name))
    }

    pub fn remove_image(&self, name: &str) -> Result<(), ImageOpError> {
        let name: ImageName = name.parse()?;
        let _serial = lock(&self.import_lock);
        let unlisted = image::remove(&self.db, &name)?;
        // Its ready sandboxes go with it (they hold its layers).
        self.drop_ready(Some(&name));
        self.collect(crate::store::Scope::Released, unlisted)?;
        Ok(())
    }

    // ---- sandboxes ----
}
