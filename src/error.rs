//! The crate's error type.

use std::fmt;

/// A specialised `Result` for lockgate operations.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What went wrong in a lockgate operation.
///
/// Every variant says what was being attempted. Use [`Error::is_retryable`] to
/// decide whether trying again later can help (a dropped connection, a
/// timeout) or not (bad configuration, a malformed key).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A builder was given a value it cannot work with (a zero TTL, an empty
    /// prefix, zero concurrency, ...). Reported when the value is set, never
    /// at run time.
    #[error("invalid configuration: {0}")]
    Config(String),

    /// A lock key or message id that cannot be used (for example, empty).
    #[error("invalid key: {0}")]
    InvalidKey(String),

    /// Redis failed, or could not be reached, while `attempted` was under way.
    #[error("redis error while {attempted}: {source}")]
    Redis {
        /// What lockgate was doing, for example "acquiring lock `order-7`".
        attempted: String,
        /// The error redis-rs reported.
        #[source]
        source: redis::RedisError,
    },

    /// Redis answered, but not with the shape lockgate's script promises.
    /// This points at a key that was modified by hand or a foreign script
    /// sharing the key prefix.
    #[error("unexpected reply while {attempted}: {detail}")]
    UnexpectedReply {
        /// What lockgate was doing.
        attempted: String,
        /// What was wrong with the reply.
        detail: String,
    },

    /// A worker's service failed in `poll_ready`, which in tower means it
    /// can serve no more requests; the worker stopped.
    #[error("the worker's service failed: {0}")]
    Service(#[source] crate::BoxError),

    /// A [durable](crate::Locker::require_replicas) locker's write (an
    /// acquire or an extend) reached fewer replicas than required within the
    /// timeout, or (at start-up) fewer replicas than required confirmed.
    /// Fail-closed: the lock was released (`released`). Retryable: replicas
    /// that lag or reconnect may confirm the next attempt.
    #[error(
        "{attempted}: only {acked} of {wanted} replicas confirmed within {timeout:?}{}",
        if *released { "; the lock was released" } else { "" }
    )]
    NotReplicated {
        /// What lockgate was doing, for example "acquiring lock `order-7`".
        attempted: String,
        /// The replicas required.
        wanted: u32,
        /// The replicas that confirmed (`WAIT`'s reply).
        acked: u32,
        /// How long `WAIT` waited.
        timeout: std::time::Duration,
        /// Whether the lock was released because of it (false when there
        /// was no lock, or the release failed and it expires with its TTL).
        released: bool,
    },

    /// [`Locker::require_replicas`](crate::Locker::require_replicas) cannot
    /// work with this server: it rejects `WAIT` (some managed services, a
    /// read-only replica, a renamed command).
    #[error("replication durability is unavailable: {detail}")]
    DurabilityUnsupported {
        /// What the server said.
        detail: String,
    },

    /// A fence was asked for a lease that no longer holds its lock (it
    /// expired, or another holder took it): none is issued, since it could
    /// be higher than the next holder's.
    #[error(
        "lock `{key}` is not held by this lease any more (it expired or was taken); no fence issued"
    )]
    NotHeld {
        /// The user's key.
        key: String,
    },

    /// A key stayed busy for the whole wait of [`Locker::lock`](crate::Locker::lock)
    /// (or [`with_lock`](crate::Locker::with_lock)): its holder's lease
    /// still runs for [`Contended::retry_after`](crate::Contended::retry_after).
    /// Retryable.
    #[error(transparent)]
    Contended(crate::Contended),

    /// The lock of [`Locker::with_lock`](crate::Locker::with_lock) was lost
    /// while its work ran (a renewal found it expired or taken): the work's
    /// writes may have raced the next holder's.
    #[error("lost lock `{key}` while its work ran")]
    LockLost {
        /// The user's key.
        key: String,
    },

    /// A message could not be serialized into JSON.
    #[error("could not encode message: {0}")]
    Encode(#[source] serde_json::Error),
}

impl Error {
    /// The same error once more, for each of several operations it failed
    /// together (the runs of one script call): a Redis error or an
    /// unexpected reply as it is; any other as an unexpected reply that
    /// tells it.
    pub(crate) fn again(&self) -> Error {
        match self {
            Error::Redis { attempted, source } => Error::Redis {
                attempted: attempted.clone(),
                source: source.clone(),
            },
            Error::UnexpectedReply { attempted, detail } => Error::UnexpectedReply {
                attempted: attempted.clone(),
                detail: detail.clone(),
            },
            other => Error::UnexpectedReply {
                attempted: "settling several operations in one call".into(),
                detail: other.to_string(),
            },
        }
    }

    /// Whether the same operation may succeed if tried again later: true for
    /// connection loss, timeouts, cluster redirections and the transient
    /// states of a failover (`LOADING`, `READONLY`, `MASTERDOWN`,
    /// `CLUSTERDOWN`, `TRYAGAIN`), and a write too few replicas confirmed
    /// ([`Error::NotReplicated`]); false for bad
    /// input, bad configuration and unexpected replies.
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Redis { source, .. } => {
                source.is_io_error()
                    || source.is_timeout()
                    || source.is_connection_dropped()
                    || source.is_connection_refusal()
                    || source.is_cluster_error()
                    || matches!(
                        source.kind(),
                        redis::ErrorKind::Server(
                            redis::ServerErrorKind::BusyLoading
                                | redis::ServerErrorKind::TryAgain
                                | redis::ServerErrorKind::ClusterDown
                                | redis::ServerErrorKind::MasterDown
                                | redis::ServerErrorKind::ReadOnly
                        )
                    )
            }
            Error::NotReplicated { .. } | Error::Contended(_) => true,
            _ => false,
        }
    }

    /// Whether the server refused the connection's user: a command, key or
    /// channel its ACL rule does not allow (`NOPERM`, whose message names
    /// what is missing), or failed authentication. Waiting seldom helps: a
    /// [`Worker`](crate::Worker) stops with such an error once it has lasted
    /// 5 s.
    pub fn is_denied(&self) -> bool {
        match self {
            Error::Redis { source, .. } => matches!(
                source.kind(),
                redis::ErrorKind::Server(redis::ServerErrorKind::NoPerm)
                    | redis::ErrorKind::AuthenticationFailed
            ),
            _ => false,
        }
    }

    /// The underlying redis-rs error, if Redis was involved.
    pub fn redis_error(&self) -> Option<&redis::RedisError> {
        match self {
            Error::Redis { source, .. } => Some(source),
            _ => None,
        }
    }

    pub(crate) fn config(msg: impl fmt::Display) -> Self {
        Error::Config(msg.to_string())
    }

    /// Wraps a redis-rs error; `attempted` is only formatted on failure.
    pub(crate) fn redis(attempted: impl fmt::Display) -> impl FnOnce(redis::RedisError) -> Self {
        move |source| Error::Redis {
            attempted: attempted.to_string(),
            source,
        }
    }

    pub(crate) fn reply(attempted: impl fmt::Display, detail: impl fmt::Display) -> Self {
        Error::UnexpectedReply {
            attempted: attempted.to_string(),
            detail: detail.to_string(),
        }
    }
}
