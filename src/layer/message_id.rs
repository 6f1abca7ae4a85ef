//! The id a consumer gives the message it calls the service for
//! ([`with_message_id`](super::with_message_id)), taken by the first
//! [`LockLayer`](super::LockLayer) or [`RateLimitLayer`](super::RateLimitLayer)
//! its request passes: a deferral of that layer pushes the message under it.

use std::cell::RefCell;

tokio::task_local! {
    /// Set around a service's `call` only (never its future, where a
    /// handler's own calls come from), until a layer takes it.
    static MESSAGE_ID: RefCell<Option<String>>;
}

/// Calls `f` with `id` available to the first layer that takes it.
pub(crate) fn provide<R>(id: Option<String>, f: impl FnOnce() -> R) -> R {
    MESSAGE_ID.sync_scope(RefCell::new(id), f)
}

/// Takes the id the current call's message was given, if no one took it.
pub(crate) fn take() -> Option<String> {
    MESSAGE_ID
        .try_with(|slot| slot.borrow_mut().take())
        .ok()
        .flatten()
}
