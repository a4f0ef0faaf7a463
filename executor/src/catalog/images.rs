//! Images and their layers (`images`, `image_layers`, `layers`): rows an
//! import writes all at once, and removal that returns the layers no
//! image or snapshot uses any more.

use rusqlite::params;
use serde::{Deserialize, Serialize};

use super::sql::{Conn, Optional};
use super::{now, q, Db, DbError};
use crate::ids::{ImageName, LayerId};
use crate::oci::{Digest, ImageConfig};

/// The name of [`Db::rootfs_image`].
pub const ROOTFS_IMAGE: &str = "strata/rootfs:v1";

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct LayerRow {
    /// Its directory under `layers/`: the diff_id hex for a content-addressed
    /// layer, `s<snapshot id>` for a suspended sandbox's upper.
    pub id: LayerId,
    /// sha256 hex of its tar; `None` until a suspended layer is sealed.
    pub diff_id: Option<Digest>,
    pub size: u64,
    pub entries: u64,
}

impl LayerRow {
    /// A layer named by its content (`id`: its diff_id).
    pub fn content(id: LayerId, size: u64, entries: u64) -> LayerRow {
        LayerRow { diff_id: id.digest(), id, size, entries }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ImageRow {
    pub id: i64,
    pub name: String,
    pub manifest_digest: Digest,
    pub config_digest: Digest,
    pub config: ImageConfig,
    /// Layer diff_ids (also their layer ids), bottom first (OCI order).
    pub layers: Vec<LayerId>,
    /// The digest of each layer's compressed blob, as imported or pulled
    /// (kept in `blobs/` since imports keep them).
    pub blobs: Vec<Digest>,
    pub created_at: i64,
}

pub(super) fn insert_layer(tx: &Conn, layer: &LayerRow) -> Result<(), DbError> {
    tx.execute(
        "INSERT INTO layers (id, diff_id, size, entries, created_at) VALUES (?1, ?2, ?3, ?4, ?5) ON CONFLICT DO NOTHING",
        params![layer.id, layer.diff_id.as_ref().map(Digest::hex), layer.size as i64, layer.entries as i64, now()],
    )
    .map_err(q("insert layer"))?;
    Ok(())
}

pub(super) fn insert_image_in(
    tx: &Conn,
    name: &ImageName,
    manifest_digest: &Digest,
    config_digest: &Digest,
    config: &str,
    layers: &[(LayerRow, Digest)],
) -> Result<i64, DbError> {
    let image_id: i64 = tx
        .query_row(
            "INSERT INTO images (name, manifest_digest, config_digest, config, created_at) \
             VALUES (?1, ?2, ?3, ?4, ?5) RETURNING id",
            params![name.as_str(), manifest_digest, config_digest, config, now()],
            |r| r.get(0),
        )
        .map_err(q("insert image"))?;
    for (pos, (layer, blob)) in layers.iter().enumerate() {
        insert_layer(tx, layer)?;
        tx.execute(
            "INSERT INTO image_layers (image_id, position, layer_id, blob_digest) VALUES (?1, ?2, ?3, ?4)",
            params![image_id, pos as i64, layer.id, blob],
        )
        .map_err(q("insert image layer"))?;
    }
    Ok(image_id)
}

pub(super) fn delete_layer_if_unused(tx: &Conn, id: &str) -> Result<bool, DbError> {
    let used = tx
        .query_row(
            "SELECT 1 FROM image_layers WHERE layer_id = ?1 UNION ALL SELECT 1 FROM snapshots WHERE layer_id = ?1 LIMIT 1",
            params![id],
            |_| Ok(()),
        )
        .optional()
        .map_err(q("layer users"))?
        .is_some();
    if !used {
        tx.execute("DELETE FROM layers WHERE id = ?1", params![id]).map_err(q("delete layer"))?;
    }
    Ok(!used)
}

impl Db {
    pub fn layer_exists(&self, id: &str) -> Result<bool, DbError> {
        self.conn
            .query_row("SELECT 1 FROM layers WHERE id = ?1", params![id], |_| Ok(()))
            .optional()
            .map(|o| o.is_some())
            .map_err(q("layer exists"))
    }

    /// Whether an image layer or a snapshot lists blob `digest`.
    pub fn blob_listed(&self, digest: &str) -> Result<bool, DbError> {
        self.conn
            .query_row(
                "SELECT EXISTS (SELECT 1 FROM snapshots WHERE blob_digest = ?1) \
                 OR EXISTS (SELECT 1 FROM image_layers WHERE blob_digest = ?1)",
                params![digest],
                |r| r.get(0),
            )
            .map_err(q("blob listed"))
    }

    /// Every blob digest (`sha256:<hex>`) a snapshot or an image layer
    /// refers to.
    pub fn all_blobs(&self) -> Result<std::collections::HashSet<String>, DbError> {
        self.conn
            .query("SELECT blob_digest FROM snapshots UNION SELECT blob_digest FROM image_layers", &[], |r| r.get(0))
            .map_err(q("list blobs"))
    }

    pub fn all_layers(&self) -> Result<Vec<String>, DbError> {
        self.conn.query("SELECT id FROM layers", &[], |r| r.get(0)).map_err(q("list layers"))
    }

    /// Insert an image and any of its layers not yet known, in one transaction.
    /// Fails with a constraint error if the name is taken.
    pub fn insert_image(
        &mut self,
        name: &ImageName,
        manifest_digest: &Digest,
        config_digest: &Digest,
        config: &ImageConfig,
        layers: &[(LayerRow, Digest /* the layer's blob */)],
    ) -> Result<i64, DbError> {
        let config =
            serde_json::to_string(config).map_err(|source| DbError::Decode { what: "image config", source })?;
        let tx = self.conn.transaction(false).map_err(q("begin insert image"))?;
        let image_id = insert_image_in(&tx, name, manifest_digest, config_digest, &config, layers)?;
        tx.commit().map_err(q("commit insert image"))?;
        Ok(image_id)
    }

    /// The image of sandboxes that run on a host directory (a create's
    /// `rootfs`, containerd's mounted root): [`ROOTFS_IMAGE`], no layers and
    /// an empty config, inserted the first time one is made (a lineage and
    /// a sandbox row name an image).
    pub fn rootfs_image(&mut self) -> Result<ImageRow, DbError> {
        let name: ImageName = ROOTFS_IMAGE.parse().map_err(|e| DbError::Invalid(format!("{e}")))?;
        if let Some(row) = self.image_by_name(&name)? {
            return Ok(row);
        }
        let config = ImageConfig::default();
        let config_json =
            serde_json::to_vec(&config).map_err(|source| DbError::Decode { what: "image config", source })?;
        let config_digest = Digest::sha256(&config_json);
        let manifest = format!(r#"{{"schemaVersion":2,"config":{{"digest":"{config_digest}"}},"layers":[]}}"#);
        // Another daemon of the fleet may insert it first: then it is theirs.
        if let Err(e) = self.insert_image(&name, &Digest::sha256(manifest.as_bytes()), &config_digest, &config, &[]) {
            tracing::debug!("the rootfs image: {e}; reading it back");
        }
        self.image_by_name(&name)?.ok_or_else(|| DbError::Invalid(format!("image {ROOTFS_IMAGE} could not be made")))
    }

    pub(super) fn image_from_row(&self, r: (i64, String, Digest, Digest, String, i64)) -> Result<ImageRow, DbError> {
        let (id, name, manifest_digest, config_digest, config, created_at) = r;
        let config =
            serde_json::from_str(&config).map_err(|source| DbError::Decode { what: "image config", source })?;
        let pairs: Vec<(LayerId, Digest)> = self
            .conn
            .query(
                "SELECT layer_id, blob_digest FROM image_layers WHERE image_id = ?1 ORDER BY position",
                params![id],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .map_err(q("image layers"))?;
        let (layers, blobs) = pairs.into_iter().unzip();
        Ok(ImageRow { id, name, manifest_digest, config_digest, config, layers, blobs, created_at })
    }

    pub(super) const IMAGE_COLS: &'static str = "id, name, manifest_digest, config_digest, config, created_at";

    pub fn image_by_name(&self, name: &ImageName) -> Result<Option<ImageRow>, DbError> {
        self.image_where("name = ?1", name.as_str())
    }

    pub fn image_by_id(&self, id: i64) -> Result<Option<ImageRow>, DbError> {
        self.image_where("id = ?1", id)
    }

    pub(super) fn image_where(&self, cond: &str, arg: impl rusqlite::ToSql) -> Result<Option<ImageRow>, DbError> {
        let sql = format!("SELECT {} FROM images WHERE {cond}", Self::IMAGE_COLS);
        let row = self
            .conn
            .query_row(&sql, params![arg], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?, r.get(5)?)))
            .optional()
            .map_err(q("get image"))?;
        row.map(|r| self.image_from_row(r)).transpose()
    }

    pub fn list_images(&self) -> Result<Vec<ImageRow>, DbError> {
        let sql = format!("SELECT {} FROM images ORDER BY name", Self::IMAGE_COLS);
        let rows: Vec<_> = self
            .conn
            .query(&sql, &[], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?, r.get(5)?)))
            .map_err(q("list images"))?;
        rows.into_iter().map(|r| self.image_from_row(r)).collect()
    }

    /// Delete an image and return the ids of layers nothing uses any
    /// more (their rows are deleted too; the caller removes the directories).
    /// Refuses (returns `Ok(Err(users))`) while sandboxes use the image.
    pub fn delete_image(&mut self, image_id: i64) -> Result<Result<Vec<String>, Vec<String>>, DbError> {
        let tx = self.conn.transaction(true).map_err(q("begin delete image"))?;
        // Captures that failed hold nothing: they go with the image (kept
        // if anything else refuses it: the transaction is not committed).
        let failed: Vec<String> = {
            tx.query(
                "SELECT id FROM snapshots WHERE image_id = ?1 AND state = 'failed' \
                     AND json_extract(info, '$.capture_error') IS NOT NULL",
                params![image_id],
                |r| r.get(0),
            )
            .map_err(q("failed captures"))?
        };
        for id in &failed {
            let layer: String = tx
                .query_row("SELECT layer_id FROM snapshots WHERE id = ?1", params![id], |r| r.get(0))
                .map_err(q("failed capture"))?;
            tx.execute("DELETE FROM snapshots WHERE id = ?1", params![id]).map_err(q("delete failed capture"))?;
            delete_layer_if_unused(&tx, &layer)?;
        }
        let users: Vec<String> = {
            tx.query("SELECT id FROM sandboxes WHERE image_id = ?1 UNION ALL SELECT 'snapshot ' || id FROM snapshots WHERE image_id = ?1", params![image_id], |r| r.get(0)).map_err(q("image users"))?
        };
        if !users.is_empty() {
            return Ok(Err(users));
        }
        let layers: Vec<String> = {
            tx.query("SELECT DISTINCT layer_id FROM image_layers WHERE image_id = ?1", params![image_id], |r| r.get(0))
                .map_err(q("image layers"))?
        };
        // Lineages of the image that hold no snapshot go with it (with
        // their restore records); one that holds any was refused above.
        tx.execute(
            "DELETE FROM work_contexts WHERE image_id = ?1 \
             AND NOT EXISTS (SELECT 1 FROM snapshots s WHERE s.work_context = work_contexts.id)",
            params![image_id],
        )
        .map_err(q("delete image lineages"))?;
        tx.execute("DELETE FROM images WHERE id = ?1", params![image_id]).map_err(q("delete image"))?;
        let mut orphans = Vec::new();
        for l in layers {
            if delete_layer_if_unused(&tx, &l)? {
                orphans.push(l);
            }
        }
        tx.commit().map_err(q("commit delete image"))?;
        Ok(Ok(orphans))
    }
}
