//! Ports in through the E2B listener, as E2B's proxy serves them: a
//! request whose `Host` is `<port>-<id>.<domain>` (what the SDK's
//! `get_host(port)` returns) goes to that port of the sandbox, HTTP and
//! WebSocket alike. The daemon connects inside the sandbox's network
//! namespace (to its `127.0.0.1:port`), so a sandbox needs no network for
//! it. A sandbox made with `network.allowPublicTraffic: false` answers only
//! requests carrying its `e2b-traffic-access-token`.
//!
//! The request is relayed as hyper parsed it (one connection to the port
//! per request); an upgrade (`101`) turns both sides into a byte pipe.

use std::sync::Arc;

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::json;
use tokio::sync::mpsc;

use super::{respond, same_secret, Body, E2b, RespBody};
use crate::daemon::lock;
use crate::error::chain;

/// The header a private sandbox's port URLs need.
pub const TRAFFIC_TOKEN: &str = "e2b-traffic-access-token";

fn refuse(status: u16, id: &str, message: &str) -> Response<Body> {
    let body = json!({"sandboxId": id, "code": status, "message": message});
    respond(super::Resp::json(status, body))
}

impl E2b {
    /// The Strata sandbox that E2B sandbox `id` runs in, if this request
    /// may reach its ports; else the status and message of the refusal.
    fn port_target(&self, id: &str, headers: &hyper::HeaderMap) -> Result<String, (u16, String)> {
        let row = match lock(&self.d.db).e2b_sandbox(id) {
            Ok(Some(row)) => row,
            Ok(None) => return Err((502, format!("sandbox {id} was not found"))),
            Err(e) => return Err((500, chain(&e))),
        };
        if let Some(token) = &row.spec.traffic_token {
            let given = headers.get(TRAFFIC_TOKEN).and_then(|v| v.to_str().ok());
            let why = match given {
                None => {
                    format!("Sandbox is secured with traffic access token. Token header '{TRAFFIC_TOKEN}' is missing")
                }
                Some(g) if !same_secret(g, token) => {
                    format!("Sandbox is secured with traffic access token. Token header '{TRAFFIC_TOKEN}' is invalid")
                }
                Some(_) => String::new(),
            };
            if !why.is_empty() {
                return Err((403, why));
            }
        }
        match row.sandbox.as_deref().map(|s| self.d.sandbox(s)) {
            Some(Ok(sb)) if sb.is_alive() => Ok(sb.id.to_string()),
            Some(Err(_)) => match self.d.sandbox_elsewhere(row.sandbox.as_deref().unwrap_or_default()) {
                Ok(Some(host)) => Err((502, format!("sandbox {id} runs on host {host}"))),
                _ => Err((502, format!("sandbox {id} is paused or ended"))),
            },
            _ => Err((502, format!("sandbox {id} is paused or ended"))),
        }
    }

    /// Relay `req` to `port` of E2B sandbox `id`.
    pub(super) async fn forward(self: Arc<Self>, mut req: Request<Incoming>, port: u16, id: String) -> Response<Body> {
        let this = self.clone();
        let target = match tokio::task::block_in_place(|| this.port_target(&id, req.headers())) {
            Ok(t) => t,
            Err((status, why)) => return refuse(status, &id, &why),
        };
        let d = self.d.clone();
        let stream = match tokio::task::spawn_blocking(move || d.connect_port(&target, port)).await {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => {
                let why = format!("sandbox {id} is running but port {port} is not open ({})", chain(&e));
                return refuse(502, &id, &why);
            }
            Err(e) => return refuse(500, &id, &e.to_string()),
        };
        let stream = match stream.set_nonblocking(true).and_then(|()| tokio::net::TcpStream::from_std(stream)) {
            Ok(s) => s,
            Err(e) => return refuse(500, &id, &e.to_string()),
        };
        let (mut sender, conn) = match hyper::client::conn::http1::handshake::<_, Incoming>(TokioIo::new(stream)).await
        {
            Ok(pair) => pair,
            Err(e) => return refuse(502, &id, &format!("port {port}: {e}")),
        };
        tokio::spawn(async move {
            let _ = conn.with_upgrades().await;
        });
        req.headers_mut().remove(TRAFFIC_TOKEN);
        let client_side = req.headers().contains_key(hyper::header::UPGRADE).then(|| hyper::upgrade::on(&mut req));
        let mut resp = match sender.send_request(req).await {
            Ok(r) => r,
            Err(e) => return refuse(502, &id, &format!("port {port} answered no HTTP: {e}")),
        };
        if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
            if let Some(client_side) = client_side {
                let server_side = hyper::upgrade::on(&mut resp);
                tokio::spawn(async move {
                    if let (Ok(a), Ok(b)) = (client_side.await, server_side.await) {
                        let _ = tokio::io::copy_bidirectional(&mut TokioIo::new(a), &mut TokioIo::new(b)).await;
                    }
                });
            }
            let (parts, _) = resp.into_parts();
            return Response::from_parts(parts, Body(RespBody::Whole(Bytes::new())));
        }
        // The body streams through as the port sends it.
        let (parts, mut body) = resp.into_parts();
        let (tx, rx) = mpsc::channel(8);
        tokio::spawn(async move {
            while let Some(Ok(frame)) = body.frame().await {
                if let Ok(data) = frame.into_data() {
                    if tx.send(data).await.is_err() {
                        break;
                    }
                }
            }
        });
        Response::from_parts(parts, Body(RespBody::Frames(rx)))
    }
}
