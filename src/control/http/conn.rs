//! # Connections: accept, cap, timeouts, shutdown
//!
//! The accept loop of the control plane, written out instead of
//! `axum::serve` because that one can set neither a timer nor a read
//! timeout on hyper's connections, and sleeps on a timer after an accept
//! error (which panics on a runtime built without one).
//!
//! | limit | what it bounds | on a breach |
//! |---|---|---|
//! | [`Limits::max_connections`] | open connections (one fd each) | the next `accept` waits for a slot; the kernel queues the caller |
//! | [`Limits::header_read_timeout`] | a request head, and an idle keep-alive connection between requests | hyper closes the connection |
//! | accept errors (`EMFILE`, `ENFILE`, `ENOBUFS`, `ENOMEM`) | — | logged; accept again after a back-off of 50 ms doubling to 1 s; the loop never ends on one |
//!
//! The body read timeout is the handler's ([`super::read_body`]): it
//! answers 408.
//!
//! **Shutdown.** When `shutdown` resolves the listener is dropped (the port
//! closes), every connection is told to finish the request it serves and
//! close (an idle one closes at once), and the loop returns once the last
//! one has. The caller races this against its own deadline.

use std::future::Future;
use std::io;
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};

/// The first back-off after an accept error.
const ACCEPT_BACKOFF_MIN: Duration = Duration::from_millis(50);
/// The longest back-off after repeated accept errors.
const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);

/// What one connection may hold.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    /// Open connections at most.
    pub max_connections: usize,
    /// The longest wait for a request head (idle keep-alive included).
    pub header_read_timeout: Duration,
}

/// An accept error that concerns one connection only (the peer went away
/// between the handshake and `accept`): accept the next one at once.
fn per_connection(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::Interrupted
    )
}

/// Serve `router` on `listener` until `shutdown` resolves, then close
/// gracefully (module docs). Needs a runtime with I/O and timers.
pub(crate) async fn run(
    listener: TcpListener,
    router: Router,
    limits: Limits,
    shutdown: impl Future<Output = ()>,
) {
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    // Every connection task holds a receiver: `closed()` on the sender
    // resolves once the last one is gone.
    let (close_tx, close_rx) = watch::channel(());
    let mut shutdown = pin!(shutdown);
    let mut backoff = ACCEPT_BACKOFF_MIN;
    loop {
        // A slot first, so that a full server leaves callers in the
        // kernel's queue instead of taking an fd for each.
        let slot = tokio::select! {
            biased;
            () = &mut shutdown => break,
            s = Arc::clone(&slots).acquire_owned() => s.expect("the slot semaphore is never closed"),
        };
        let accepted = tokio::select! {
            biased;
            () = &mut shutdown => break,
            a = listener.accept() => a,
        };
        let stream = match accepted {
            Ok((stream, _)) => {
                backoff = ACCEPT_BACKOFF_MIN;
                stream
            }
            Err(e) if per_connection(&e) => continue,
            Err(e) => {
                // Out of fds or memory: what is queued stays queued; try
                // again once connections or files may have closed.
                tracing::error!(error = %e, retry_in = ?backoff, "control plane: accept failed");
                tokio::select! {
                    biased;
                    () = &mut shutdown => break,
                    () = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(ACCEPT_BACKOFF_MAX);
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(router.clone());
        let mut close = close_rx.clone();
        tokio::spawn(async move {
            let _slot = slot;
            let mut builder = http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_read_timeout);
            let mut conn = pin!(builder.serve_connection(TokioIo::new(stream), service));
            let mut closing = false;
            loop {
                tokio::select! {
                    _ = conn.as_mut() => break,
                    r = close.changed(), if !closing => {
                        // Sent (or the loop is gone): finish and close.
                        let _ = r;
                        closing = true;
                        conn.as_mut().graceful_shutdown();
                    }
                }
            }
            drop(close);
        });
    }
    drop(listener);
    let _ = close_tx.send(());
    drop(close_rx);
    close_tx.closed().await;
}
