//! `/metrics`, `/healthz` and `/readyz` on `--metrics-addr` (default 127.0.0.1:9965).
//!
//! Loopback by default: the endpoints say which nodes exist and whether the brake holds, which
//! is not for the whole network; a DaemonSet that wants scraping sets a pod address explicitly.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

use super::Telemetry;

/// Binds now (so a bad address fails start-up), then serves in the background.
pub async fn serve(addr: SocketAddr, telemetry: Arc<Telemetry>) -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let t = telemetry.clone();
            tokio::spawn(async move {
                let service = service_fn(move |req| {
                    let t = t.clone();
                    async move { Ok::<_, Infallible>(respond(&req, &t)) }
                });
                let _ = http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    Ok(local)
}

fn respond(req: &Request<Incoming>, t: &Telemetry) -> Response<Full<Bytes>> {
    let (status, content_type, body) = match req.uri().path() {
        "/metrics" => (
            StatusCode::OK,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
            t.metrics.encode(),
        ),
        "/healthz" => match t.health() {
            Ok(()) => (StatusCode::OK, "text/plain", "ok\n".into()),
            Err(why) => (
                StatusCode::SERVICE_UNAVAILABLE,
                "text/plain",
                format!("{why}\n"),
            ),
        },
        "/readyz" => match t.ready() {
            Ok(detail) => (StatusCode::OK, "text/plain", format!("{detail}\n")),
            Err(why) => (
                StatusCode::SERVICE_UNAVAILABLE,
                "text/plain",
                format!("{why}\n"),
            ),
        },
        _ => (
            StatusCode::NOT_FOUND,
            "text/plain",
            "not found: try /metrics, /healthz, /readyz\n".into(),
        ),
    };
    let mut resp = Response::new(Full::new(Bytes::from(body)));
    *resp.status_mut() = status;
    if let Ok(v) = content_type.parse() {
        resp.headers_mut().insert(hyper::header::CONTENT_TYPE, v);
    }
    resp
}
