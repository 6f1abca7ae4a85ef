//! Exponential backoff with full jitter, bounded by attempts and total wait.

use std::time::Duration;

use crate::error::{Error, Result};

/// How long to wait between tries, and when to stop trying.
///
/// The n-th wait (counting from 0) is drawn uniformly from
/// `0..=min(max, base * 2^n)` ("full jitter"), so that contenders spread out
/// instead of retrying in lock step. A backoff stops after `max_attempts`
/// tries in all, or once `max_elapsed` of waiting would be exceeded, or both.
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
    max_attempts: Option<u32>,
    /// Total waiting allowed; `None` for no limit.
    max_elapsed: Option<Duration>,
}

impl Backoff {
    /// Waits capped at `base`, doubling per try up to `max`, with at most 10
    /// tries. Errors when `base` is zero or `max < base`.
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

    /// Stops when the waits would add up to more than `d`.
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
        let cap = self.cap(n);
        cap.mul_f64(rand::random::<f64>())
    }

    /// The longest all waits together may take: `max_elapsed` if set, else
    /// the sum of the caps of the waits `max_attempts` allows; `None` when
    /// neither bounds it.
    pub fn budget(&self) -> Option<Duration> {
        if let Some(limit) = self.max_elapsed {
            return Some(limit);
        }
        let attempts = self.max_attempts?;
        Some((0..attempts.saturating_sub(1)).map(|n| self.cap(n)).sum())
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
    fn rejects_bad_arguments() {
        assert!(Backoff::exponential(Duration::ZERO, MS).is_err());
        assert!(Backoff::exponential(MS * 10, MS).is_err());
    }

    #[test]
    fn caps_double_up_to_max_and_never_overflow() {
        let b = Backoff::exponential(MS * 10, MS * 500).unwrap();
        let caps: Vec<_> = (0..8).map(|n| b.cap(n).as_millis()).collect();
        assert_eq!(caps, [10, 20, 40, 80, 160, 320, 500, 500]);
        assert_eq!(b.cap(u32::MAX), MS * 500);
        for n in 0..100 {
            assert!(b.delay(n) <= b.cap(n));
        }
    }

    #[test]
    fn stops_at_attempts_and_elapsed() {
        let b = Backoff::exponential(MS, MS * 4).unwrap().max_attempts(3);
        assert!(b.next(1, Duration::ZERO).is_some());
        assert!(b.next(2, Duration::ZERO).is_some());
        assert!(b.next(3, Duration::ZERO).is_none());
        let b = b.unlimited_attempts().max_elapsed(MS * 10);
        assert!(b.next(1000, MS * 9).is_some_and(|d| d <= MS));
        assert!(b.next(1, MS * 10).is_none());
        assert_eq!(
            Backoff::exponential(MS, MS)
                .unwrap()
                .max_attempts(0)
                .next(1, Duration::ZERO),
            None
        );
    }
}
