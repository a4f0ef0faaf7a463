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
    /// rootfs {0:?}: {1}
    Rootfs(String, String),
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
            CreateError::Name(_) | CreateError::Rootfs(..) => ErrorKind::InvalidArgument,
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
        if let Some(dir) = req.rootfs.clone() {
            return self.create_on_dir(req, dir);
        }
        // Validate everything before reserving anything.
        let name: ImageName = req.image.parse()?;
        let (image_name, work_context, baseline) = (req.image.clone(), req.work_context.clone(), req.baseline.clone());
        let launch = req.into_launch();
        if let Some(key) = &baseline {
            return Ok(self.create_from_baseline(key, &image_name, work_context.as_deref(), launch)?);
        }
        let launch = self.launch_spec(launch)?;
        let image = lock(&self.db).image_by_name(&name)?.ok_or(CreateError::NoImage(name))?;
        let layers = image.layers.clone();
        self.launch_new(image, layers, work_context.as_deref(), launch)
    }

    /// `rootfs`: a sandbox on a host directory (containerd's mounted root),
    /// in a new lineage of the image named (its config for the commands),
    /// else of the empty `strata/rootfs:v1`.
    fn create_on_dir(&self, req: CreateRequest, dir: String) -> Result<SandboxInfo, CreateError> {
        let bad = |why: String| CreateError::Rootfs(dir.clone(), why);
        if req.baseline.is_some() {
            return Err(bad("a baseline is started from its own layers, not a host directory".into()));
        }
        let path = std::path::PathBuf::from(&dir);
        if !path.is_absolute() {
            return Err(bad("must be an absolute path".into()));
        }
        match std::fs::metadata(&path) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => return Err(bad("is not a directory".into())),
            Err(e) => return Err(bad(e.to_string())),
        }
        let named = (!req.image.is_empty()).then(|| req.image.parse::<ImageName>()).transpose()?;
        let work_context = req.work_context.clone();
        let mut launch = self.launch_spec(req.into_launch())?;
        launch.root_dir = Some(path);
        let image = match named {
            Some(name) => lock(&self.db).image_by_name(&name)?.ok_or(CreateError::NoImage(name))?,
            None => lock(&self.db).rootfs_image()?,
        };
        self.launch_new(image, Vec::new(), work_context.as_deref(), launch)
    }

    /// Launch on `layers` of `image` in a new lineage (named
    /// `work_context`, else a random one), which goes again if the launch
    /// fails.
    fn launch_new(
        &self,
        image: crate::catalog::ImageRow,
        layers: Vec<crate::ids::LayerId>,
        work_context: Option<&str>,
        launch: super::LaunchSpec,
    ) -> Result<SandboxInfo, CreateError> {
        let wc = self.new_lineage(work_context, image.id, crate::model::StartKind::Image, None)?;
        let base = Base {
            layers,
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
