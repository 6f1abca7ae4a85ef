//! The release listener a [`Locker`](super::Locker) made by `connect` or
//! `connect_cluster` opens for itself and its clones, in the background, the
//! first time a waiter needs one: waiters poll with their backoff until it is
//! up, and whenever it is down.

use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use tokio::time::Instant;

use super::ReleaseListener;

/// The pause after a failed attempt to open the listener (waiters poll).
const RETRY: Duration = Duration::from_secs(1);

/// Opens a [`ReleaseListener`] on first need; shared by a locker's clones.
pub(crate) struct AutoListener {
    open: Open,
    listener: OnceLock<ReleaseListener>,
    attempt: Mutex<Attempt>,
}

/// How an [`AutoListener`] reaches its server.
pub(crate) enum Open {
    Server(Box<redis::Client>),
    /// A Redis Cluster: makes the builder of the subscriber's connection
    /// (see [`ReleaseListener::connect_cluster`]).
    Cluster(Box<dyn Fn() -> redis::cluster::ClusterClientBuilder + Send + Sync>),
    /// A listener given open ([`AutoListener::opened`]).
    Given,
}

/// Whether an attempt to open the listener is under way, or when the next may.
enum Attempt {
    Idle,
    Running,
    FailedUntil(Instant),
}

impl std::fmt::Debug for AutoListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AutoListener")
            .field("open", &self.listener.get().is_some())
            .finish_non_exhaustive()
    }
}

impl AutoListener {
    pub(crate) fn opened(listener: ReleaseListener) -> Self {
        let this = Self::new(Open::Given);
        let _ = this.listener.set(listener);
        this
    }

    pub(crate) fn new(open: Open) -> Self {
        Self {
            open,
            listener: OnceLock::new(),
            attempt: Mutex::new(Attempt::Idle),
        }
    }

    /// The listener if it is open; else starts opening it in the background
    /// (unless an attempt is under way or one failed less than a second ago)
    /// and returns `None`: the caller polls for now.
    pub(crate) fn get(self: &std::sync::Arc<Self>) -> Option<ReleaseListener> {
        if let Some(listener) = self.listener.get() {
            return Some(listener.clone());
        }
        // A few assignments under the lock: nothing to poison.
        let mut attempt = self.attempt.lock().unwrap_or_else(|e| e.into_inner());
        match *attempt {
            Attempt::Running => return None,
            Attempt::FailedUntil(until) if Instant::now() < until => return None,
            _ => *attempt = Attempt::Running,
        }
        drop(attempt);
        let this = self.clone();
        tokio::spawn(async move {
            let opened = match &this.open {
                Open::Server(client) => ReleaseListener::connect((**client).clone()).await,
                Open::Cluster(builder) => ReleaseListener::connect_cluster(builder()).await,
                // Set at creation: never opened here.
                Open::Given => return,
            };
            let next = match opened {
                Ok(listener) => {
                    let _ = this.listener.set(listener);
                    Attempt::Idle
                }
                Err(error) => {
                    tracing::warn!(%error, "could not open the release listener; waiters poll meanwhile");
                    Attempt::FailedUntil(Instant::now() + RETRY)
                }
            };
            *this.attempt.lock().unwrap_or_else(|e| e.into_inner()) = next;
        });
        None
    }
}
