//! `Backoff`: caps, delays, limits and budgets, through the public API.

use std::time::Duration;

use lockgate::Backoff;

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

/// Runs `f` on a thread and fails if it has not returned within `bound`
/// (a budget computed in a loop of 4·10⁹ steps would hang the test).
fn within<T: Send + 'static>(bound: Duration, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(bound)
        .unwrap_or_else(|e| panic!("did not return within {bound:?}: {e}"))
}

#[test]
fn budget_of_u32_max_attempts_returns_at_once() {
    let budget = within(Duration::from_secs(1), || {
        Backoff::exponential(MS, MS * 4)
            .unwrap()
            .max_attempts(u32::MAX)
            .budget()
    });
    // 1 + 2 + 4, then 4 ms for each of the other u32::MAX - 4 waits.
    let expected = MS * 7 + (MS * 4).saturating_mul(u32::MAX - 4);
    assert_eq!(budget, Some(expected));
}

#[test]
fn budget_matches_the_sum_of_the_caps() {
    for (base, max) in [(1, 1), (1, 4), (10, 500), (3, 1 << 30)] {
        let b = Backoff::exponential(MS * base, MS * max).unwrap();
        for attempts in [1, 2, 3, 7, 31, 32, 33, 40, 100] {
            let b = b.max_attempts(attempts);
            let sum: Duration = (0..attempts - 1).map(|n| b.cap(n)).sum();
            assert_eq!(b.budget(), Some(sum), "{base} {max} {attempts}");
        }
    }
}

#[test]
fn huge_durations_saturate_instead_of_panicking() {
    let huge = within(Duration::from_secs(1), || {
        std::panic::catch_unwind(|| {
            let b = Backoff::exponential(Duration::MAX / 4, Duration::MAX)
                .unwrap()
                .max_attempts(u32::MAX);
            (b.cap(5), b.delay(5), b.budget(), b.next(3, Duration::MAX))
        })
    });
    let (cap, delay, budget, next) = huge.expect("no panic");
    assert_eq!(cap, Duration::MAX);
    assert!(delay <= Duration::MAX);
    assert_eq!(budget, Some(Duration::MAX));
    assert!(next.is_some());
}

#[test]
fn budget_is_the_smaller_of_both_limits() {
    let b = Backoff::exponential(MS, MS)
        .unwrap()
        .max_attempts(3)
        .max_elapsed(Duration::from_secs(1));
    assert_eq!(b.budget(), Some(MS * 2));
    let b = b.max_elapsed(MS);
    assert_eq!(b.budget(), Some(MS));
}
