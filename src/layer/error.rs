//! Error types of the [`LockLayer`](super::LockLayer), downcastable from its
//! `BoxError`. A busy key under `fail()` is [`Contended`](crate::Contended).

/// The lock was lost while the handler ran: a renewal found it expired or
/// taken by another holder, the lease ran out without a confirmed renewal
/// (see [`HeldLock::lost`](crate::HeldLock::lost)), or the release at the
/// end found it gone. Writes the handler made after that moment may race
/// with the next holder's; fencing tokens make them detectable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("lost lock `{key}`{} while the handler ran{}", .fence.map_or(String::new(), |f| format!(" (fence {f})")), if *.completed { "; the handler completed" } else { "; the handler was cancelled" })]
#[non_exhaustive]
pub struct LockLost {
    /// The user's key.
    pub key: String,
    /// The fence of the lost lease, if the handler asked for one.
    pub fence: Option<u64>,
    /// Whether the handler ran to completion (`OnLost::Report`) or was
    /// cancelled (`OnLost::Cancel`).
    pub completed: bool,
}

/// A claimed job was to be deferred, but it had been deferred
/// `max_deferrals` times already.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("message `{id}` was deferred {deferrals} times for busy lock `{key}`; giving up")]
#[non_exhaustive]
pub struct TooManyDeferrals {
    /// The message id.
    pub id: String,
    /// The busy key.
    pub key: String,
    /// Deferrals so far.
    pub deferrals: u32,
}

/// A claimed job was to be rescheduled in place, but its claim was no
/// longer held: its lease had run out and it went back to the queue.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("could not defer message `{id}`: its claim is no longer held (lease ran out)")]
#[non_exhaustive]
pub struct ClaimLost {
    /// The message id.
    pub id: String,
}
