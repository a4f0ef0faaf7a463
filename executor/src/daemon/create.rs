//! `create`: a new sandbox on an image, in a new lineage.

use crate::catalog::DbError;
use crate::error::{Classify, ErrorKind};
use crate::ids::ImageName;
use crate::types::{CreateRequest, SandboxInfo};

use super::{baseline, lineage, lock, sandbox_info, Base, Daemon, LaunchError};

/// Why `create_sandbox` failed.
#[derive(Debug, thiserror::Error, displaydoc::Display)]
pub enum CreateError {
    /// {0}
    Name(#[from] crate::ids::BadImageName),
    /// image {0} not found
    NoImage(ImageName),
    /// {0}
    Launch(#[from] LaunchError),
    /// {0}
    Lineage(#[from] lineage::LineageError),
    /// {0}
    Baseline(#[from] baseline::BaselineError),
    /// {0}
    Db(#[from] DbError),
}

impl Classify for CreateError {
    fn kind(&self) -> ErrorKind {
        match self {
            CreateError::Name(_) => ErrorKind::InvalidArgument,
            CreateError::NoImage(_) => ErrorKind::NotFound,
            CreateError::Launch(e) => e.kind(),
            CreateError::Lineage(e) => e.kind(),
            CreateError::Baseline(e) => e.kind(),
            CreateError::Db(e) => e.kind(),
        }
    }
}

impl Daemon {
    pub fn create_sandbox(&self, req: CreateRequest) -> Result<SandboxInfo, CreateError> {
        // Validate everything before reserving anything.
        let name: ImageName = req.image.parse()?;
        let (image_name, work_context, baseline) = (req.image.clone(), req.work_context.clone(), req.baseline.clone());
        let launch = req.into_launch();
        if let Some(key) = &baseline {
            return Ok(self.create_from_baseline(key, &image_name, work_context.as_deref(), launch)?);
        }
        let launch = self.launch_spec(launch)?;
        let image = lock(&self.db).image_by_name(&name)?.ok_or(CreateError::NoImage(name))?;
        let wc = self.new_lineage(work_context.as_deref(), image.id, crate::model::StartKind::Image, None)?;
        let base = Base {
            layers: image.layers.clone(),
            image,
            snapshot: None,
            work_context: wc.clone(),
            observed_head: None,
            rung: crate::model::Rung::Image,
            captured_in_userns: false,
            fell: Vec::new(),
            network: None,
        };
        match self.launch(&base, launch) {
            Ok(sb) => Ok(sandbox_info(&sb)),
            Err(e) => {
                let _ = lock(&self.db).delete_unused_work_context(&wc);
                Err(e.into())
            }
        }
    }
}
