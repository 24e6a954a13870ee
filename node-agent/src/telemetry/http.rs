//! `/metrics`, `/healthz` and `/readyz` on `--metrics-addr` (default 127.0.0.1:9965).
//!
//! Loopback by default: the endpoints say which nodes exist and whether the brake holds, which
//! is not for the whole network; a DaemonSet that wants scraping sets a pod address explicitly.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

use super::Telemetry;
use crate::runtime::Backoff;

/// Connections served at once. A scrape or a probe is one short request; more wait in the
/// listen backlog, where they hold no file descriptor of the agent's.
const MAX_CONNECTIONS: usize = 64;
/// The longest a connection is served: a client that opens one and sends nothing (or sends
/// slowly) holds nothing longer.
const CONNECTION_TIMEOUT: Duration = Duration::from_secs(5);
/// Retries of a failed accept. Out of file descriptors, every accept fails at once until one
/// is freed: retried without a pause, the loop would take a core.
const ACCEPT_BACKOFF: Backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));

/// Binds now (so a bad address fails start-up), then serves in the background.
pub async fn serve(addr: SocketAddr, telemetry: Arc<Telemetry>) -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    tokio::spawn(async move {
        let mut backoff = ACCEPT_BACKOFF;
        loop {
            let Ok(slot) = slots.clone().acquire_owned().await else {
                return;
            };
            let (stream, _) = accept_with_backoff(|| listener.accept(), &mut backoff).await;
            let t = telemetry.clone();
            tokio::spawn(async move {
                let service = service_fn(move |req| {
                    let t = t.clone();
                    async move { Ok::<_, Infallible>(respond(&req, &t)) }
                });
                let served = http1::Builder::new().serve_connection(TokioIo::new(stream), service);
                let _ = tokio::time::timeout(CONNECTION_TIMEOUT, served).await;
                drop(slot);
            });
        }
    });
    Ok(local)
}

/// The next connection `accept` gives, waiting out `backoff` after each failure (and saying
/// so, at most once per wait).
async fn accept_with_backoff<T, F: Future<Output = std::io::Result<T>>>(
    mut accept: impl FnMut() -> F,
    backoff: &mut Backoff,
) -> T {
    loop {
        match accept().await {
            Ok(c) => {
                backoff.reset();
                return c;
            }
            Err(e) => {
                let wait = backoff.next_delay();
                tracing::warn!(
                    "metrics endpoint: accepting a connection failed ({e}); trying again in {wait:?}"
                );
                tokio::time::sleep(wait).await;
            }
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Out of file descriptors, accept fails at once, every time: the loop waits between
    /// tries, doubling to its cap, instead of spinning.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_failing_accept_is_retried_with_backoff_not_in_a_loop() {
        let mut tries = 0u32;
        let mut backoff = ACCEPT_BACKOFF;
        let accept = || {
            tries += 1;
            std::future::ready(Err::<(), _>(std::io::Error::from_raw_os_error(
                libc::EMFILE,
            )))
        };
        let waited = tokio::time::timeout(
            Duration::from_secs(60),
            accept_with_backoff(accept, &mut backoff),
        )
        .await;
        assert!(waited.is_err(), "it never gives up");
        // 0.1 + 0.2 + ... + 3.2 s, then every 5 s: 17 tries in a minute.
        assert!((10..=20).contains(&tries), "{tries} tries in a minute");
    }
}
