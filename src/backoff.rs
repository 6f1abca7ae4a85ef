//! Exponential backoff with full jitter, bounded by attempts and total wait.

use std::time::Duration;

use crate::error::{Error, Result};

/// How long to wait between tries, and when to stop trying.
///
/// The n-th wait (counting from 0) is drawn uniformly from
/// `0..=min(max, base * 2^n)` ("full jitter"), so that contenders spread out
/// instead of retrying in lock step. A backoff stops after `max_attempts`
/// tries in all, or once `max_elapsed` has passed, whichever comes first.
/// **As built by [`exponential`](Self::exponential), it stops after 10
/// tries** (the first included); change that with
/// [`max_attempts`](Self::max_attempts) or lift it with
/// [`unlimited_attempts`](Self::unlimited_attempts).
///
/// ```
/// use std::time::Duration;
/// use lockgate::Backoff;
///
/// let backoff = Backoff::exponential(Duration::from_millis(10), Duration::from_millis(500))?
///     .max_attempts(5)
///     .max_elapsed(Duration::from_secs(2));
/// assert!(backoff.delay(3) <= Duration::from_millis(80));
/// # Ok::<_, lockgate::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    /// The cap of the first wait.
    base: Duration,
    /// The cap of any wait.
    max: Duration,
    /// Tries in all, including the first; `None` for no limit.
    pub(crate) max_attempts: Option<u32>,
    /// Total waiting allowed; `None` for no limit.
    pub(crate) max_elapsed: Option<Duration>,
}

impl Backoff {
    /// Waits capped at `base`, doubling per try up to `max`, and **at most
    /// 10 tries in all** (the first included: 9 waits), so that a key held
    /// for good cannot hold its contenders forever. Set another limit with
    /// [`max_attempts`](Self::max_attempts), or none with
    /// [`unlimited_attempts`](Self::unlimited_attempts) (then bound the
    /// total with [`max_elapsed`](Self::max_elapsed)). Errors when `base`
    /// is zero or `max < base`.
    ///
    /// ```
    /// use std::time::Duration;
    /// use lockgate::Backoff;
    ///
    /// let ms = Duration::from_millis;
    /// let backoff = Backoff::exponential(ms(10), ms(500))?;
    /// assert!(backoff.next(9, Duration::ZERO).is_some()); // a 10th try
    /// assert_eq!(backoff.next(10, Duration::ZERO), None); // no 11th
    /// assert!(backoff.unlimited_attempts().next(1000, Duration::ZERO).is_some());
    /// # Ok::<_, lockgate::Error>(())
    /// ```
    pub fn exponential(base: Duration, max: Duration) -> Result<Self> {
        if base.is_zero() {
            return Err(Error::config("backoff base must be greater than zero"));
        }
        if max < base {
            return Err(Error::config(format_args!(
                "backoff max ({max:?}) must not be below its base ({base:?})"
            )));
        }
        Ok(Self {
            base,
            max,
            max_attempts: Some(10),
            max_elapsed: None,
        })
    }

    /// Stops after `n` tries in all, the first included (`0` counts as 1: the
    /// first try always happens).
    pub fn max_attempts(mut self, n: u32) -> Self {
        self.max_attempts = Some(n.max(1));
        self
    }

    /// Stops once `d` has passed: [`next`](Self::next) answers `None` when
    /// `waited` has reached `d`, and shortens the last wait to end at `d`.
    /// A [`LockLayer`](crate::LockLayer) counts the whole call in `waited`:
    /// time in its local queue, the waits, and the round trips.
    pub fn max_elapsed(mut self, d: Duration) -> Self {
        self.max_elapsed = Some(d);
        self
    }

    /// No limit on the number of tries (set [`max_elapsed`](Self::max_elapsed)
    /// to keep the total bounded).
    pub fn unlimited_attempts(mut self) -> Self {
        self.max_attempts = None;
        self
    }

    /// The cap of the `n`-th wait (from 0): `min(max, base * 2^n)`.
    pub fn cap(&self, n: u32) -> Duration {
        let factor = 1u32.checked_shl(n.min(31)).unwrap_or(u32::MAX);
        self.base.saturating_mul(factor).min(self.max)
    }

    /// A jittered wait for the `n`-th retry (from 0).
    pub fn delay(&self, n: u32) -> Duration {
        self.cap(n).mul_f64(rand::random::<f64>())
    }

    /// The longest all waits together may take: the smaller of
    /// `max_elapsed` and the sum of the caps of the waits `max_attempts`
    /// allows (whichever are set); `None` when neither bounds it.
    ///
    /// Computed in constant time (caps stop changing after 31 doublings),
    /// saturating at `Duration::MAX`.
    pub fn budget(&self) -> Option<Duration> {
        let by_attempts = self
            .max_attempts
            .map(|max| self.sum_of_caps(max.saturating_sub(1)));
        match (by_attempts, self.max_elapsed) {
            (Some(a), Some(e)) => Some(a.min(e)),
            (a, e) => a.or(e),
        }
    }

    /// The sum of the caps of the first `waits` waits, saturating.
    fn sum_of_caps(&self, waits: u32) -> Duration {
        // cap(n) = cap(DOUBLINGS) for every n >= DOUBLINGS (see `cap`).
        const DOUBLINGS: u32 = 31;
        let growing = waits.min(DOUBLINGS);
        let head = (0..growing).fold(Duration::ZERO, |sum, n| sum.saturating_add(self.cap(n)));
        head.saturating_add(self.cap(DOUBLINGS).saturating_mul(waits - growing))
    }

    /// How many tries a wait of `waited` stands for: the fewest `k >= 1`
    /// whose first `k` waits' caps add up to at least `waited` (a wait of
    /// zero stands for none). Used to charge time spent waiting elsewhere
    /// (the layer's local queue) against `max_attempts`.
    pub(crate) fn tries_covered(&self, waited: Duration) -> u32 {
        if waited.is_zero() {
            return 0;
        }
        // sum_of_caps is monotone in its argument: binary search, 32 steps.
        let (mut lo, mut hi) = (1u32, u32::MAX);
        if self.sum_of_caps(hi) < waited {
            return hi;
        }
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if self.sum_of_caps(mid) >= waited {
                hi = mid;
            } else {
                lo = mid + 1;
            }
        }
        lo
    }

    /// The wait before try `tried + 1`, having tried `tried` times and waited
    /// `waited` so far; `None` when the limits say stop.
    pub fn next(&self, tried: u32, waited: Duration) -> Option<Duration> {
        if self.max_attempts.is_some_and(|max| tried >= max) {
            return None;
        }
        let delay = self.delay(tried.saturating_sub(1));
        match self.max_elapsed {
            Some(limit) if waited >= limit => None,
            Some(limit) => Some(delay.min(limit - waited)),
            None => Some(delay),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn a_wait_is_charged_as_the_tries_whose_waits_it_covers() {
        let b = Backoff::exponential(MS * 10, MS * 40).unwrap(); // 10, 20, 40, 40, ...
        assert_eq!(b.tries_covered(Duration::ZERO), 0);
        assert_eq!(b.tries_covered(Duration::from_nanos(1)), 1);
        assert_eq!(b.tries_covered(MS * 10), 1);
        assert_eq!(b.tries_covered(MS * 11), 2);
        assert_eq!(b.tries_covered(MS * 30), 2);
        assert_eq!(b.tries_covered(MS * 70), 3);
        assert_eq!(b.tries_covered(MS * 71), 4);
        assert_eq!(b.tries_covered(MS * 110), 4);
        assert_eq!(b.tries_covered(Duration::MAX), u32::MAX);
    }
}
