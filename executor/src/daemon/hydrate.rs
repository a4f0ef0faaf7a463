//! Hydration: a pulled layer's blob unpacked into the store, once per host,
//! by the background hydrator or by the first launch that needs it.

use super::distribution::{
    host_io, layer_compression, layer_source, media_type, parse_digest, store_err, TransferError, WireLayer,
};
use super::lock;
use crate::catalog::Unhydrated;
use crate::daemon::Daemon;
use crate::oci::{self};

impl Daemon {
    /// Start the background hydrator (pulled layers' trees) and queue the
    /// layers a previous daemon left unhydrated.
    pub fn start_hydrator(self: &std::sync::Arc<Self>) {
        let (tx, rx) = std::sync::mpsc::channel::<String>();
        let d = self.clone();
        let spawned = std::thread::Builder::new().name("hydrator".into()).spawn(move || {
            let _ = strata_shim::sys::set_thread_nice(10);
            for id in rx {
                if let Err(e) = d.hydrate_layer(&id) {
                    tracing::error!("hydrate layer {id}: {}", crate::error::chain(&e));
                }
            }
        });
        if let Err(e) = spawned {
            tracing::error!("start hydrator: {e}");
            return;
        }
        if let Ok(pending) = lock(&self.db).unhydrated_layers_with(false) {
            for id in pending {
                let _ = tx.send(id.to_string());
            }
        }
        *lock(&self.hydrator) = Some(tx);
    }

    pub(crate) fn queue_hydration(&self, id: &str) {
        if let Some(tx) = lock(&self.hydrator).as_ref() {
            let _ = tx.send(id.to_string());
        }
    }

    /// Make sure layer `id`'s tree is in place: unpack it now if a pull
    /// left it to be hydrated, or wait for the unpack in progress. A layer
    /// whose unpack failed is refused with the reason.
    pub(crate) fn hydrate_layer(&self, id: &str) -> Result<(), TransferError> {
        let mut busy = lock(&self.hydrating);
        while busy.contains(id) {
            busy = self.hydrated.wait(busy).unwrap_or_else(|p| p.into_inner());
        }
        let Some(u) = lock(&self.db).unhydrated(id)? else { return Ok(()) };
        if let Some(e) = &u.error {
            return Err(TransferError::Unpackable { layer: id.to_string(), why: e.clone() });
        }
        busy.insert(id.to_string());
        drop(busy);
        let r = self.unpack_pulled(&u);
        lock(&self.hydrating).remove(id);
        self.hydrated.notify_all();
        r
    }

    fn unpack_pulled(&self, u: &Unhydrated) -> Result<(), TransferError> {
        let store = &self.rt.store;
        let digest = u.blob_digest.clone();
        let diff_id = parse_digest(&format!("sha256:{}", u.layer_id), "pulled layer")?;
        let compression = layer_compression(u.compression);
        let blob = store.blob_path(digest.hex());
        if store.layer_dir(&u.layer_id).join("fs").is_dir() {
            // Unpacked before a crash, not yet recorded.
            lock(&self.db).hydrated(&u.layer_id, 0, 0)?;
            return Ok(());
        }
        let size = blob.metadata()?.len();
        crate::failpoint::hit("hydrate:unpack");
        let work = store.new_tmp("hydrate").map_err(store_err)?;
        let result = self.leased(|lease| {
            let dir = work.join("layer");
            std::fs::create_dir_all(dir.join("fs")).map_err(host_io)?;
            let l = WireLayer { digest, size, media_type: media_type(compression).into(), compression, diff_id };
            let stats = match oci::unpack_layer(&layer_source(&blob, &l), &dir.join("fs")) {
                Ok(s) => s,
                Err(e) if e.is_io() => return Err(TransferError::Unpack(Box::new(e))),
                Err(e) => {
                    let why = crate::error::chain(&e);
                    lock(&self.db).hydration_failed(&u.layer_id, &why)?;
                    return Err(TransferError::Unpackable { layer: u.layer_id.to_string(), why });
                }
            };
            store.commit_layer(&dir, &u.layer_id, true, lease).map_err(store_err)?;
            // False if its snapshot was removed meanwhile: the layer is
            // then the collector's.
            lock(&self.db).hydrated(&u.layer_id, stats.bytes, stats.entries)?;
            tracing::info!("hydrated pulled layer {} ({} entries)", u.layer_id, stats.entries);
            Ok(())
        });
        let _ = crate::store::remove_tree(&work);
        result
    }
}
