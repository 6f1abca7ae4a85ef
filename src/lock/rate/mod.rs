//! Rate limits per key: at most r admissions in any window of a period, by
//! the server's clock (see docs/limits.md, "Rate limits per key").
//!
//! A key's admissions are one sorted set, `<prefix>:rate:{<key>}`, of
//! admission times in µs (a sliding-window log), kept by one script. A
//! message that will come back later (a deferral) can **reserve** its slot:
//! it is then admitted at once, in the period it was deferred to; calls that
//! come meanwhile queue behind the reservations.

use std::sync::LazyLock;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use redis::Script;
use redis::aio::ConnectionLike;

use super::{Contended, Locker, Token};
use crate::error::{Error, Result};
use crate::keys;
use crate::script::{self, Program};

static ADMIT: LazyLock<Script> =
    LazyLock::new(|| Script::new(&format!("{RATE_LUA}\n{}", include_str!("admit.lua"))));

/// The rate limit as a Lua function (`admit`), also for the keyed queue.
pub(crate) const RATE_LUA: &str = include_str!("rate.lua");

/// The most admissions per period (the log keeps one entry per admission).
pub const MAX_RATE: u32 = 1_000_000;

/// The longest period (the log's µs in Lua numbers are exact far beyond).
pub const MAX_PERIOD: Duration = Duration::from_secs(366 * 24 * 3600);

/// A rate limit: at most `limit` admissions in any window of `period`, at
/// most `burst` of them in any window of `period × burst / limit`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rate {
    limit: u32,
    period: Duration,
    burst: u32,
}

impl Rate {
    /// At most `limit` admissions in any window of `period`; all of them may
    /// come at once (see [`burst`](Self::burst)). Errors on a limit of 0 or
    /// above [`MAX_RATE`], or a period under 1 ms or above [`MAX_PERIOD`].
    pub fn new(limit: u32, period: Duration) -> Result<Self> {
        if limit == 0 || limit > MAX_RATE {
            return Err(Error::Config(format!(
                "a rate limit admits 1 to {MAX_RATE} calls per period, got {limit}"
            )));
        }
        if period < Duration::from_millis(1) || period > MAX_PERIOD {
            return Err(Error::Config(format!(
                "a rate limit's period must be 1 ms to {MAX_PERIOD:?}, got {period:?}"
            )));
        }
        Ok(Self {
            limit,
            period,
            burst: limit,
        })
    }

    /// At most `burst` admissions back to back: at most `burst` in any window
    /// of `period × burst / limit` (`burst(1)`: evenly spaced). Errors unless
    /// 1 ≤ `burst` ≤ `limit`, and when that window is under 1 µs.
    pub fn burst(self, burst: u32) -> Result<Self> {
        if burst == 0 || burst > self.limit {
            return Err(Error::Config(format!(
                "a rate limit's burst must be 1 to its limit ({}), got {burst}",
                self.limit
            )));
        }
        let rate = Self { burst, ..self };
        if rate.burst_window_us() < 1 {
            return Err(Error::Config(format!(
                "{} per {:?} with bursts of {burst} leaves under 1 µs between admissions",
                self.limit, self.period
            )));
        }
        Ok(rate)
    }

    /// The most admissions in any window of [`period`](Self::period).
    pub fn limit(&self) -> u32 {
        self.limit
    }

    /// The window the limit counts in.
    pub fn period(&self) -> Duration {
        self.period
    }

    /// The most admissions back to back (see [`burst`](Self::burst)).
    pub fn burst_size(&self) -> u32 {
        self.burst
    }

    /// As the keyed scripts take it: `<limit>/<period µs>/<burst>/<window µs>`.
    pub(crate) fn spec(&self) -> String {
        let (limit, period, burst) = (self.limit, self.period_us(), self.burst);
        format!("{limit}/{period}/{burst}/{}", self.burst_window_us())
    }

    fn period_us(&self) -> u64 {
        self.period.as_micros() as u64
    }

    fn burst_window_us(&self) -> u64 {
        (self.period.as_micros() * u128::from(self.burst) / u128::from(self.limit)) as u64
    }
}

/// What [`Locker::admit`] decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admission {
    /// Admitted, at this time by the server's clock.
    Admitted(SystemTime),
    /// Over the limit: [`Contended::retry_after`] is when the next slot opens.
    Limited(Contended),
}

/// What the admit script said, for the layer.
pub(crate) enum Decision {
    /// At this server time (µs since the epoch).
    Admitted(u64),
    /// The next slot is this far ahead (reserved for the member when asked).
    Later { wait: Duration },
}

/// Server µs since the epoch as a `SystemTime`.
pub(crate) fn server_time(us: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_micros(us)
}

impl<C> Locker<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// Admits one call under `key`'s rate limit, or says exactly when the
    /// next slot opens (see [the module](self)). One round trip, one
    /// script. Errors on an empty key and on a Redis failure.
    pub async fn admit(&self, key: &str, rate: &Rate) -> Result<Admission> {
        let token = Token::random();
        Ok(match self.decide(key, rate, token.as_str(), false).await? {
            Decision::Admitted(at) => Admission::Admitted(server_time(at)),
            Decision::Later { wait } => Admission::Limited(Contended::new(key.to_owned(), wait)),
        })
    }

    /// The Redis key of `key`'s rate limit log, `<prefix>:rate:{<key>}`.
    pub fn rate_key(&self, key: &str) -> String {
        keys::rate_key(&self.config.prefix, key)
    }

    /// Runs the admit script for `member` (a call's token, or a message's id,
    /// which finds its reservation), reserving the next slot if `reserve`.
    pub(crate) async fn decide(
        &self,
        key: &str,
        rate: &Rate,
        member: &str,
        reserve: bool,
    ) -> Result<Decision> {
        if key.is_empty() {
            return Err(Error::InvalidKey("rate limit key must not be empty".into()));
        }
        let mut cmd = ADMIT.call(1);
        cmd.arg(self.rate_key(key))
            .arg(rate.limit)
            .arg(rate.period_us())
            .arg(rate.burst)
            .arg(rate.burst_window_us())
            .arg(member)
            .arg(if reserve { "1" } else { "0" });
        let reply: Vec<i64> = script::run(&ADMIT, &cmd, &mut self.conn.clone())
            .await
            .map_err(Error::redis(format_args!("admitting a call of `{key}`")))?;
        let value = |v: i64| u64::try_from(v).unwrap_or(0);
        match reply[..] {
            [1, at, ..] => Ok(Decision::Admitted(value(at))),
            [0, wait, _reserved] => Ok(Decision::Later {
                wait: Duration::from_micros(value(wait)),
            }),
            _ => Err(Error::reply(
                format_args!("admitting a call of `{key}`"),
                format_args!("expected [1, time] or [0, wait, reserved], got {reply:?}"),
            )),
        }
    }
}
