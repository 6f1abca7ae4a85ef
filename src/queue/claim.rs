//! What proves a claim: a [`Job`](super::Job)'s token, owned
//! ([`ClaimToken`]) or borrowed ([`ClaimRef`]), and the [`Claim`] trait
//! that lets the queue's settlements take either.

use std::sync::Arc;

use super::keyed::Held;

/// Something that identifies a claimed message: a [`Job`](super::Job), or
/// a reference to one. Lets [`Queue::ack`](super::Queue::ack) and friends
/// take jobs of any payload type.
pub trait Claim {
    /// The message id and claim.
    fn claim_ref(&self) -> ClaimRef<'_>;
}

/// An owned proof of a claim: what a worker keeps of a job it handed to a
/// service, to settle it afterwards. Two tokens are equal when they prove
/// the same claim.
#[derive(Debug, Clone)]
pub struct ClaimToken {
    pub(super) id: String,
    pub(super) claim: u64,
    pub(super) failures: u32,
    pub(super) stalls: u32,
    pub(super) held: Option<Arc<Held>>,
    /// The shard it was claimed from (0 for a keyed message).
    pub(super) shard: u16,
    /// For a keyed message a worker runs later in a run: the messages of
    /// the run handled before it, not acknowledged yet. Whatever settles
    /// it by this token (a `LockLayer` that defers it in place, say)
    /// acknowledges them first, as the worker's cut of the run would: the
    /// settlement lets the key go, and would otherwise put them back in
    /// line to run again.
    pub(super) run_before: Option<Arc<[ClaimToken]>>,
}

impl ClaimToken {
    /// The message id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Which attempt the claimed delivery is (1 for the first).
    pub fn attempt(&self) -> u32 {
        self.failures.saturating_add(1)
    }

    /// For a keyed message, its key, the token its lock (or permit) holds
    /// and the key's permits (0: its lock).
    pub(crate) fn held_lock(&self) -> Option<(&str, crate::lock::Token, u32)> {
        self.held
            .as_ref()
            .map(|held| (held.key.as_str(), held.token, held.permits))
    }

    /// The messages of its run handled before it, not acknowledged yet
    /// (see `run_before`).
    pub(crate) fn run_before(&self) -> &[ClaimToken] {
        self.run_before.as_deref().unwrap_or_default()
    }

    /// Whether it follows others of its run, claimed with them (see
    /// [`Queue::claim_runs`]).
    pub(crate) fn continues_run(&self) -> bool {
        self.held.as_ref().is_some_and(|held| held.run > 0)
    }

    /// Whether its run may read ahead ([`Queue::extend_run`]): a keyed
    /// message under its key's lock, no rate limit.
    pub(crate) fn reads_ahead(&self) -> bool {
        (self.held.as_ref()).is_some_and(|held| held.permits == 0 && !held.rated)
    }

    /// Non-zero when the message may have an error entry (`ack` then
    /// deletes it): after a failed attempt, and after a lease expiry, which
    /// `recover` records as an error too.
    pub(super) fn failures(&self) -> u32 {
        self.failures.saturating_add(self.stalls)
    }
    pub(super) fn member(&self) -> String {
        format!("{}:{}", self.id, self.claim)
    }
}

impl ClaimToken {
    /// What identifies the claim (not `run_before`, which the worker adds
    /// to the copy it hands its service).
    fn identity(&self) -> (&str, u64, u32, u32, &Option<Arc<Held>>, u16) {
        let (id, claim, failures) = (self.id.as_str(), self.claim, self.failures);
        (id, claim, failures, self.stalls, &self.held, self.shard)
    }
}

impl PartialEq for ClaimToken {
    fn eq(&self, other: &Self) -> bool {
        self.identity() == other.identity()
    }
}

impl Eq for ClaimToken {}

impl std::hash::Hash for ClaimToken {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.identity().hash(state);
    }
}

impl Claim for ClaimToken {
    fn claim_ref(&self) -> ClaimRef<'_> {
        ClaimRef(self)
    }
}

/// The parts of a claimed message that prove its claim.
#[derive(Debug, Clone, Copy)]
pub struct ClaimRef<'a>(pub(super) &'a ClaimToken);

impl Claim for ClaimRef<'_> {
    fn claim_ref(&self) -> ClaimRef<'_> {
        *self
    }
}

impl ClaimRef<'_> {
    /// An owned copy.
    pub fn to_token(&self) -> ClaimToken {
        self.0.clone()
    }

    /// See [`ClaimToken::continues_run`].
    pub(crate) fn continues_run(&self) -> bool {
        self.0.continues_run()
    }
}

/// The claim `job` proves.
pub(super) fn token<J: Claim>(job: &J) -> &ClaimToken {
    job.claim_ref().0
}
