//! Claimed messages and dead letters.

use std::ops::{Deref, DerefMut};
use std::sync::Arc;
use std::time::SystemTime;

use serde::de::DeserializeOwned;

use super::keyed::Held;
use super::{Claim, ClaimRef, ClaimToken, QueueKeys, from_unix_ms};

/// A message claimed from a [`Queue`](super::Queue), with what is known about
/// its delivery. Dereferences to the payload.
#[derive(Clone)]
pub struct Job<T> {
    /// Its claim: id, claim number, failed attempts and stalls before this
    /// one, and for a keyed message its key's lock.
    token: ClaimToken,
    payload: T,
    deferrals: u32,
    priority: u8,
    enqueued_at: SystemTime,
    due_at: SystemTime,
    /// The queue it was claimed from.
    queue: Arc<QueueKeys>,
}

/// A record's header fields and payload:
/// `<enqueued_ms>:<failures>:<deferrals>:<stalls>:<payload>`, prefixed
/// `p<priority>:` for a message with a priority; records without the stall
/// counter read as 0 stalls (as `parse` in `lua/prelude.lua`, which says
/// why the two forms cannot be confused).
pub(crate) fn split_record(record: &[u8]) -> Option<Record<'_>> {
    fn num(part: &[u8]) -> Option<u64> {
        // Digits only, as the scripts' `%d+` patterns: no sign, no spaces.
        if part.is_empty() || !part.iter().all(u8::is_ascii_digit) {
            return None;
        }
        std::str::from_utf8(part).ok()?.parse().ok()
    }
    let (priority, record) = match record {
        [b'p', digit @ b'1'..=b'9', b':', rest @ ..] => (digit - b'0', rest),
        _ => (0, record),
    };
    let mut parts = record.splitn(4, |b| *b == b':');
    let enqueued = i64::try_from(num(parts.next()?)?).ok()?;
    let failures = u32::try_from(num(parts.next()?)?).ok()?;
    let deferrals = u32::try_from(num(parts.next()?)?).ok()?;
    let rest = parts.next()?;
    let (stalls, payload) = match rest.iter().position(|b| *b == b':') {
        Some(colon) => match num(&rest[..colon]).and_then(|s| u32::try_from(s).ok()) {
            Some(stalls) => (stalls, &rest[colon + 1..]),
            None => (0, rest),
        },
        // The three-counter form.
        None => (0, rest),
    };
    Some(Record {
        enqueued,
        failures,
        deferrals,
        stalls,
        payload,
        priority,
    })
}

/// [`split_record`], or for a malformed record the whole of it as the
/// payload, every count 0.
pub(crate) fn split_or_raw(record: &[u8]) -> Record<'_> {
    let raw = Record {
        payload: record,
        ..Record::default()
    };
    split_record(record).unwrap_or(raw)
}

/// The parts of a stored record.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Record<'a> {
    pub(crate) enqueued: i64,
    pub(crate) failures: u32,
    pub(crate) deferrals: u32,
    pub(crate) stalls: u32,
    pub(crate) payload: &'a [u8],
    pub(crate) priority: u8,
}

impl<T: DeserializeOwned> Job<T> {
    /// Builds a job from a claimed record, under its key's lock when `held`;
    /// on failure returns a job-shaped handle (without payload) to bury, and
    /// the reason.
    pub(crate) fn decode(
        (id, claim, held, shard): (String, u64, Option<Arc<Held>>, u16),
        due_ms: i64,
        record: &[u8],
        queue: &Arc<QueueKeys>,
    ) -> Result<Self, Box<(Job<()>, String)>> {
        let r = split_or_raw(record);
        let token = ClaimToken {
            id,
            claim,
            failures: r.failures,
            stalls: r.stalls,
            held,
            shard,
            run_before: None,
        };
        let job = Job {
            token,
            payload: (),
            deferrals: r.deferrals,
            priority: r.priority,
            enqueued_at: from_unix_ms(r.enqueued),
            due_at: from_unix_ms(due_ms),
            queue: queue.clone(),
        };
        // Only a malformed record's payload is the whole of it.
        if r.payload.len() == record.len() {
            return Err(Box::new((
                job,
                "malformed record: no `<enqueued>:<failures>:<deferrals>:<stalls>:` header".into(),
            )));
        }
        match serde_json::from_slice(r.payload) {
            Ok(payload) => Ok(job.map(|()| payload)),
            Err(e) => Err(Box::new((job, format!("could not decode payload: {e}")))),
        }
    }
}

impl<T> Job<T> {
    /// Gives it the messages of its run handled before it (see
    /// `ClaimToken::run_before`): the worker does, before handing it to
    /// its service.
    pub(crate) fn set_run_before(&mut self, handled: Arc<[ClaimToken]>) {
        self.token.run_before = Some(handled);
    }

    /// The message id.
    pub fn id(&self) -> &str {
        &self.token.id
    }

    /// The payload.
    pub fn payload(&self) -> &T {
        &self.payload
    }

    /// The payload, mutably.
    pub fn payload_mut(&mut self) -> &mut T {
        &mut self.payload
    }

    /// The payload, by value, without the claim: a plain message from here
    /// on. A `LockLayer` deferring it pushes it as a new message; to defer
    /// the job in place, put the layer over the `Job` and take the payload
    /// out below it (see docs/worker.md, "How in-place deferral finds the job").
    pub fn into_payload(self) -> T {
        self.payload
    }

    /// Which attempt this delivery is: 1 for the first, 2 after one failed
    /// attempt (a handler error), and so on. Deferrals for lock contention
    /// and leases that ran out ([`stalls`](Self::stalls)) do not count.
    pub fn attempt(&self) -> u32 {
        self.token.attempt()
    }

    /// How many times the message was deferred because its lock was busy.
    pub fn deferrals(&self) -> u32 {
        self.deferrals
    }

    /// How many times a lease on the message ran out before this delivery
    /// (its worker died or stalled). Counted apart from failed attempts.
    pub fn stalls(&self) -> u32 {
        self.token.stalls
    }

    /// Its priority, 0 (none) to 9 ([`PushOptions::priority`](super::PushOptions::priority)).
    pub fn priority(&self) -> u8 {
        self.priority
    }

    /// When the message was first pushed (server clock).
    pub fn enqueued_at(&self) -> SystemTime {
        self.enqueued_at
    }

    /// When this delivery was due (server clock).
    pub fn due_at(&self) -> SystemTime {
        self.due_at
    }

    /// The name of the queue it was claimed from.
    pub fn queue_name(&self) -> &str {
        &self.queue.name
    }

    /// The claim number of this delivery.
    pub fn claim(&self) -> u64 {
        self.token.claim
    }

    /// The message's key, for a keyed message
    /// ([`PushOptions::key`](super::PushOptions::key)): its handler runs
    /// holding the key's lock.
    pub fn key(&self) -> Option<&str> {
        self.token.held.as_ref().map(|held| held.key.as_str())
    }

    pub(crate) fn queue_keys(&self) -> &Arc<QueueKeys> {
        &self.queue
    }

    /// Replaces the payload, keeping the claim (for adapters that map a
    /// job's payload type).
    pub fn map<U>(self, f: impl FnOnce(T) -> U) -> Job<U> {
        Job {
            token: self.token,
            payload: f(self.payload),
            deferrals: self.deferrals,
            priority: self.priority,
            enqueued_at: self.enqueued_at,
            due_at: self.due_at,
            queue: self.queue,
        }
    }
}

impl<T: std::fmt::Debug> std::fmt::Debug for Job<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Job")
            .field("queue", &self.queue.name)
            .field("id", &self.token.id)
            .field("attempt", &self.attempt())
            .field("deferrals", &self.deferrals)
            .field("payload", &self.payload)
            .finish_non_exhaustive()
    }
}

impl<T> Claim for Job<T> {
    fn claim_ref(&self) -> ClaimRef<'_> {
        self.token.claim_ref()
    }
}

impl<J: Claim> Claim for &J {
    fn claim_ref(&self) -> ClaimRef<'_> {
        (**self).claim_ref()
    }
}

impl<T> Deref for Job<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.payload
    }
}

impl<T> DerefMut for Job<T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.payload
    }
}

/// A message in the dead letters.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeadLetter {
    /// The message id.
    pub id: String,
    /// Its key, for a message pushed with one ([`PushOptions::key`](super::PushOptions::key)):
    /// a keyed message's id is unique within its key.
    pub key: Option<String>,
    /// The member of its dead set: the id, or for a keyed message
    /// `<key>\0<id>` (where a page's cursor stands).
    pub(crate) stored: String,
    /// When it was buried (server clock).
    pub buried_at: SystemTime,
    /// The last error recorded for it.
    pub error: Option<String>,
    /// Failed attempts (handler errors, and the burial itself when
    /// [`Queue::bury`](super::Queue::bury) ended a delivery).
    pub failures: u32,
    /// Deferrals for lock contention.
    pub deferrals: u32,
    /// Lease expiries (its worker died or stalled).
    pub stalls: u32,
    /// The raw payload bytes (JSON, unless it was malformed).
    pub payload: Vec<u8>,
}

impl DeadLetter {
    /// A letter as `dead.lua` lists it: stored id, burial score (ms),
    /// record, error; `keyed` for a keyed partition's dead set, whose
    /// members are `<key>\0<id>`.
    pub(crate) fn new(
        keyed: bool,
        (stored, buried_ms, record, error): (String, f64, Option<Vec<u8>>, Option<String>),
    ) -> Self {
        let record = record.unwrap_or_default();
        let r = split_or_raw(&record);
        let split = keyed.then(|| super::keyed::split_stored(&stored)).flatten();
        let (key, id) = match split {
            Some((key, id)) => (Some(key.to_owned()), id.to_owned()),
            None => (None, stored.clone()),
        };
        Self {
            id,
            key,
            stored,
            buried_at: from_unix_ms(buried_ms as i64),
            error,
            failures: r.failures,
            deferrals: r.deferrals,
            stalls: r.stalls,
            payload: r.payload.to_vec(),
        }
    }

    /// Decodes the payload as `T`.
    pub fn decode<T: DeserializeOwned>(&self) -> serde_json::Result<T> {
        serde_json::from_slice(&self.payload)
    }
}

/// A fresh message id: a UUIDv7 written as 26 characters of Crockford's
/// base32. Ids generated in one process sort in generation order (the
/// schedule breaks ties in due time by id; `Uuid::now_v7` guarantees the
/// order within a process, and the fixed-length base32 keeps it byte-wise);
/// ids from different processes sort by their clocks' millisecond, then
/// arbitrarily. They are 10 bytes shorter than the hyphenated UUID, which
/// Redis stores twice per waiting message.
pub(crate) fn new_id() -> String {
    const ALPHABET: &[u8; 32] = b"0123456789ABCDEFGHJKMNPQRSTVWXYZ";
    let mut n = uuid::Uuid::now_v7().as_u128();
    let mut out = [0u8; 26];
    for slot in out.iter_mut().rev() {
        *slot = ALPHABET[(n & 31) as usize];
        n >>= 5;
    }
    out.iter().map(|&b| b as char).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_sort_in_generation_order() {
        let ids: Vec<String> = (0..1000).map(|_| new_id()).collect();
        assert!(ids.windows(2).all(|w| w[0] < w[1]));
        assert!(ids.iter().all(|id| id.len() == 26));
    }

    #[test]
    fn records_split() {
        let r = |enqueued, failures, deferrals, stalls, payload| {
            Some(Record {
                enqueued,
                failures,
                deferrals,
                stalls,
                payload,
                priority: 0,
            })
        };
        assert_eq!(
            split_record(b"17:1:2:3:{\"a\":1}"),
            r(17, 1, 2, 3, &b"{\"a\":1}"[..])
        );
        assert_eq!(split_record(b"17:1:2:3:a:b"), r(17, 1, 2, 3, &b"a:b"[..]));
        // The three-counter form of records written before stalls existed.
        assert_eq!(
            split_record(b"17:1:2:{\"a\":1}"),
            r(17, 1, 2, 0, &b"{\"a\":1}"[..])
        );
        assert_eq!(split_record(b"17:1:2:12"), r(17, 1, 2, 0, &b"12"[..]));
        assert_eq!(split_record(b"17:1:2:"), r(17, 1, 2, 0, &b""[..]));
        assert_eq!(split_record(b"17:1:2:3:"), r(17, 1, 2, 3, &b""[..]));
        assert_eq!(split_record(b"{\"a\":1}"), None);
        assert_eq!(split_record(b"1:x:2:p"), None);
        assert_eq!(split_record(b"1:+2:2:p"), None);
        assert_eq!(split_record(b"1:2:3"), None);
        // A message with a priority.
        let prioritized = split_record(b"p7:17:1:2:3:{}").unwrap();
        assert_eq!((prioritized.priority, prioritized.stalls), (7, 3));
        assert_eq!(split_record(b"p7:17:1:2:{}").unwrap().priority, 7);
        assert_eq!(split_record(b"p0:17:1:2:{}"), None);
        assert_eq!(split_record(b"p10:17:1:2:{}"), None);
    }

    /// The record format from outside (another producer, an old version, a
    /// hand edit), decoded from arbitrary input: never a panic, and never a
    /// payload misread. `PROPTEST_CASES=100000 cargo test --lib records`
    /// runs more cases.
    mod records_from_outside {
        use super::*;
        use proptest::prelude::*;

        /// A JSON text, as producers write them (serde_json's form; other
        /// encoders differ in spacing, which is payload bytes like any).
        fn json() -> impl Strategy<Value = Vec<u8>> {
            let leaf = prop_oneof![
                Just(serde_json::Value::Null),
                any::<bool>().prop_map(serde_json::Value::from),
                any::<i64>().prop_map(serde_json::Value::from),
                any::<f64>()
                    .prop_filter("finite", |f| f.is_finite())
                    .prop_map(serde_json::Value::from),
                ".*".prop_map(serde_json::Value::from),
            ];
            let value = leaf.prop_recursive(3, 16, 4, |inner| {
                prop_oneof![
                    prop::collection::vec(inner.clone(), 0..4).prop_map(serde_json::Value::from),
                    prop::collection::btree_map(".*", inner, 0..4)
                        .prop_map(|m| { serde_json::Value::Object(m.into_iter().collect()) }),
                ]
            });
            value.prop_map(|v| serde_json::to_vec(&v).expect("a Value always encodes"))
        }

        /// Arbitrary bytes, half of them shaped like headers (digits,
        /// colons, priority prefixes, signs) so that near misses are tried.
        fn bytes() -> impl Strategy<Value = Vec<u8>> {
            prop_oneof![
                prop::collection::vec(any::<u8>(), 0..64),
                "(p[0-9]{0,2}:)?[0-9:+ -]{0,24}[0-9:{}\"a-]{0,8}".prop_map(String::into_bytes),
            ]
        }

        fn with_header(header: String, payload: &[u8]) -> Vec<u8> {
            let mut record = header.into_bytes();
            record.extend_from_slice(payload);
            record
        }

        proptest! {
            #[test]
            fn any_bytes_split_or_are_refused_without_panic(record in bytes()) {
                if let Some(split) = split_record(&record) {
                    // What is read is a suffix of the record: nothing made up.
                    prop_assert!(record.ends_with(split.payload));
                    prop_assert!(split.enqueued >= 0);
                }
            }

            #[test]
            fn any_bytes_decode_or_are_refused_without_panic(record in bytes()) {
                let keys = Arc::new(QueueKeys::new("lockgate", "q"));
                let decoded = Job::<serde_json::Value>::decode(("id".into(), 1, None, 0), 0, &record, &keys);
                if let Ok(job) = decoded {
                    let split = split_record(&record).expect("decoded, so split");
                    let payload: serde_json::Value = serde_json::from_slice(split.payload).expect("decoded");
                    prop_assert_eq!(job.payload(), &payload);
                }
            }

            /// The current form, with any counters and any payload bytes at
            /// all (JSON or not): read back exactly.
            #[test]
            fn the_four_counter_form_reads_back_exactly(
                enqueued in 0..=i64::MAX,
                failures: u32,
                deferrals: u32,
                stalls: u32,
                priority in 0u8..=9,
                payload in prop::collection::vec(any::<u8>(), 0..48),
            ) {
                let prefix = if priority == 0 { String::new() } else { format!("p{priority}:") };
                let record = with_header(
                    format!("{prefix}{enqueued}:{failures}:{deferrals}:{stalls}:"),
                    &payload,
                );
                let split = split_record(&record).expect("a well-formed record");
                prop_assert_eq!(
                    (split.enqueued, split.failures, split.deferrals, split.stalls, split.priority),
                    (enqueued, failures, deferrals, stalls, priority)
                );
                prop_assert_eq!(split.payload, &payload[..]);
            }

            /// Records written before the stall counter existed, with a JSON
            /// payload (all the queue ever stored): read back exactly, with
            /// no stalls.
            #[test]
            fn the_three_counter_form_with_json_reads_back_exactly(
                enqueued in 0..=i64::MAX,
                failures: u32,
                deferrals: u32,
                payload in json(),
            ) {
                let record = with_header(format!("{enqueued}:{failures}:{deferrals}:"), &payload);
                let split = split_record(&record).expect("a well-formed record");
                prop_assert_eq!(
                    (split.enqueued, split.failures, split.deferrals, split.stalls),
                    (enqueued, failures, deferrals, 0)
                );
                prop_assert_eq!(split.payload, &payload[..]);
            }
        }
    }
}
