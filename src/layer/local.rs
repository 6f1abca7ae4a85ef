//! A FIFO per key among the tasks of this process.
//!
//! (For a key with n permits, the first n of its queue are let through.)
//!
//! Under `retry`, tasks of one process that want the same key first queue
//! here, in arrival order, and only the head of each queue contends on
//! Redis. Without it, ten local tasks on one hot key would all poll Redis
//! with backoff, and whoever happens to wake first wins: wasted round trips,
//! long tail waits, and an uneven share between tasks. With it, a released
//! lock goes to the next local waiter at once. Redis stays the authority:
//! the local queue only decides who of this process asks next.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The queues of one layer (shared by its clones and services).
#[derive(Debug, Default)]
pub(crate) struct LocalQueues {
    /// One FIFO semaphore per key with waiters (one permit for a lock, n
    /// for n permits); removed when the last leaves.
    queues: Mutex<HashMap<String, Arc<Semaphore>>>,
}

/// A place in a key's local queue; first in line once [`LocalQueues::turn`]
/// returned. Leaving (drop) hands the turn to the next waiter.
pub(crate) struct Turn {
    queues: Arc<LocalQueues>,
    key: String,
    queue: Option<Arc<Semaphore>>,
    guard: Option<OwnedSemaphorePermit>,
    /// Whether the turn had to wait for earlier tasks of this process.
    waited: bool,
}

impl LocalQueues {
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Semaphore>>> {
        // Every critical section is one map operation: nothing to poison.
        self.queues.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits for this task's turn on `key`, among the first `permits` of
    /// its queue (tokio's semaphore is fair: FIFO).
    pub(crate) async fn turn(self: &Arc<Self>, key: &str, permits: u32) -> Turn {
        let queue = self
            .map()
            .entry(key.to_owned())
            .or_insert_with(|| Arc::new(Semaphore::new(permits as usize)))
            .clone();
        // Built before waiting, so that a cancelled wait still cleans up.
        let mut turn = Turn {
            queues: self.clone(),
            key: key.to_owned(),
            queue: Some(queue.clone()),
            guard: None,
            waited: false,
        };
        // A free place is taken without waiting (tokio hands a released
        // permit straight to its first waiter, so this never jumps the
        // queue). The semaphore is never closed: `acquire` cannot fail.
        turn.guard = match queue.clone().try_acquire_owned() {
            Ok(guard) => Some(guard),
            Err(_) => {
                turn.waited = true;
                queue.acquire_owned().await.ok()
            }
        };
        turn
    }
}

impl Turn {
    /// Whether this task found earlier tasks of this process in the queue
    /// (and waited for them) before its turn came.
    pub(crate) fn waited(&self) -> bool {
        self.waited
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        self.guard = None;
        self.queue = None;
        let mut map = self.queues.map();
        // Only the map's own reference left: nobody waits on this key.
        let unused = map
            .get(&self.key)
            .is_some_and(|q| Arc::strong_count(q) == 1);
        if unused {
            map.remove(&self.key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn turns_are_fifo_and_queues_are_removed_when_empty() {
        let queues = Arc::new(LocalQueues::default());
        let first = queues.turn("k", 1).await;
        assert!(!first.waited());
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut waiters = Vec::new();
        for i in 0..5 {
            let (queues, order) = (queues.clone(), order.clone());
            waiters.push(tokio::spawn(async move {
                let turn = queues.turn("k", 1).await;
                assert!(turn.waited());
                order.lock().unwrap().push(i);
            }));
            // Let each waiter enqueue before the next one.
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        drop(first);
        for w in waiters {
            w.await.unwrap();
        }
        assert_eq!(*order.lock().unwrap(), vec![0, 1, 2, 3, 4]);
        assert!(queues.map().is_empty());
    }

    #[tokio::test]
    async fn a_cancelled_wait_leaves_nothing_behind() {
        let queues = Arc::new(LocalQueues::default());
        let held = queues.turn("k", 1).await;
        let waiting = tokio::time::timeout(Duration::from_millis(10), queues.turn("k", 1)).await;
        assert!(waiting.is_err());
        drop(held);
        assert!(queues.map().is_empty());
    }
}
