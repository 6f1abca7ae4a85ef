//! What became of a message that went through a [`LockLayer`](crate::LockLayer).

use std::time::SystemTime;

/// The response of a locked service: the handler ran, or the message was put
/// aside because its key was busy.
///
/// A deferred message is neither a success nor a failure: it will be handled
/// later, when a [`Worker`](crate::Worker) claims it from the deferral queue.
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub enum Outcome<R> {
    /// The handler ran while holding the lock, and returned this.
    Done(R),
    /// The key was busy; the message was scheduled into the deferral queue.
    Deferred {
        /// The message id in the deferral queue (the job's own id when a
        /// claimed job was rescheduled in place).
        id: String,
        /// When it is due again (server clock).
        due: SystemTime,
    },
}

impl<R> Outcome<R> {
    /// Whether the handler ran.
    pub fn is_done(&self) -> bool {
        matches!(self, Outcome::Done(_))
    }

    /// Whether the message was deferred.
    pub fn is_deferred(&self) -> bool {
        matches!(self, Outcome::Deferred { .. })
    }

    /// The handler's response, if it ran.
    pub fn done(self) -> Option<R> {
        match self {
            Outcome::Done(r) => Some(r),
            Outcome::Deferred { .. } => None,
        }
    }

    /// Maps the handler's response.
    pub fn map<U>(self, f: impl FnOnce(R) -> U) -> Outcome<U> {
        match self {
            Outcome::Done(r) => Outcome::Done(f(r)),
            Outcome::Deferred { id, due } => Outcome::Deferred { id, due },
        }
    }
}
