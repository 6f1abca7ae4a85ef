//! Dead letters paged by cursor (issue 38): every letter once, in (burial
//! time, id) order, across a sharded queue's sets and its keyed
//! partitions' sets; pages that stay put while letters are re-driven and
//! buried; letters buried in one millisecond told apart by id.

use crate::support;

use std::collections::BTreeSet;

use lockgate::queue::{DeadCursor, DeadLetter};
use lockgate::{PushOptions, Queue};
use support::{manager, ms, secs, server};

/// Every dead letter from `after` on, in pages of `limit`: each page goes
/// on in list order where the one before ended, and only the last has no
/// next.
async fn pages_from(
    q: &Queue<u64>,
    mut after: Option<DeadCursor>,
    limit: usize,
) -> Vec<DeadLetter> {
    let mut all: Vec<DeadLetter> = Vec::new();
    loop {
        let page = q.dead_letters(after.as_ref(), limit).await.unwrap();
        assert!(page.letters.len() <= limit);
        let places = page.letters.iter().map(DeadCursor::after);
        let order: Vec<DeadCursor> = after.iter().cloned().chain(places).collect();
        assert!(
            order.windows(2).all(|w| w[0] < w[1]),
            "out of order: {order:?}"
        );
        all.extend(page.letters);
        match page.next {
            Some(next) => after = Some(next),
            None => return all,
        }
    }
}

fn ids(letters: &[DeadLetter]) -> Vec<String> {
    letters.iter().map(|l| l.id.clone()).collect()
}

/// Claims every due message (in batches) and buries each.
async fn bury_all(q: &Queue<u64>) {
    loop {
        let jobs = q.claim(100, secs(30)).await.unwrap().jobs;
        if jobs.is_empty() {
            return;
        }
        for job in &jobs {
            assert!(q.bury(job, "failed").await.unwrap());
        }
    }
}

#[tokio::test]
async fn pages_cover_every_shard_and_partition_and_stay_put_while_letters_move() {
    let server = server();
    let q: Queue<u64> = Queue::new(manager(&server).await, "pages")
        .unwrap()
        .shards(3)
        .unwrap();
    let plain = (0..30).map(|i| (i, PushOptions::new().id(format!("u{i:02}"))));
    q.push_many_with(plain).await.unwrap();
    // Keyed messages, each under a key of its own: dead letters of the
    // keys' partitions.
    for i in 0..20u64 {
        let options = PushOptions::new()
            .id(format!("k{i:02}"))
            .key(format!("key-{i}"));
        q.push_with(i, options).await.unwrap();
    }
    bury_all(&q).await;
    assert_eq!(q.stats().await.unwrap().dead, 50);

    let all = pages_from(&q, None, 7).await;
    let unique: BTreeSet<String> = ids(&all).into_iter().collect();
    assert_eq!((all.len(), unique.len()), (50, 50), "each letter once");
    assert!(unique.iter().any(|id| id.starts_with('k')) && unique.contains("u29"));

    // The first page read; then a letter it showed and one further on are
    // re-driven, and a new one is buried: the next pages go on from the
    // first page's end, without the re-driven later letter, with the new
    // one last.
    let first = q.dead_letters(None, 7).await.unwrap();
    assert_eq!(ids(&first.letters), ids(&all[..7]));
    assert!(q.requeue_dead(&all[2].id).await.unwrap());
    assert!(q.requeue_dead(&all[20].id).await.unwrap());
    q.push_with(99, PushOptions::new().id("u99")).await.unwrap();
    let requeued = q.claim(10, secs(30)).await.unwrap().jobs;
    let newest = requeued.iter().find(|j| j.id() == "u99").unwrap();
    assert!(q.bury(newest, "failed").await.unwrap());
    let rest = pages_from(&q, first.next, 7).await;
    let mut expected = ids(&all[7..]);
    expected.retain(|id| *id != all[20].id);
    expected.push("u99".into());
    assert_eq!(ids(&rest), expected);
}

#[tokio::test]
async fn letters_buried_in_one_millisecond_are_paged_by_id() {
    let server = server();
    let q: Queue<u64> = Queue::new(manager(&server).await, "burst").unwrap();
    let batch = (0..50).map(|i| (i, PushOptions::new().id(format!("m{i:02}"))));
    q.push_many_with(batch).await.unwrap();
    assert_eq!(q.claim(50, ms(30)).await.unwrap().jobs.len(), 50);
    tokio::time::sleep(ms(60)).await;
    // One recover call buries all 50: one burial time.
    assert_eq!(q.recover(1).await.unwrap().buried, 50);
    let all = pages_from(&q, None, 10).await;
    assert_eq!(
        ids(&all),
        (0..50).map(|i| format!("m{i:02}")).collect::<Vec<_>>()
    );
    assert!(all.iter().all(|l| l.buried_at == all[0].buried_at));

    // The letter a cursor names is gone (re-driven), and another before
    // it: the next page starts right after the cursor's place all the same.
    let first = q.dead_letters(None, 10).await.unwrap();
    assert!(q.requeue_dead("m09").await.unwrap());
    assert!(q.requeue_dead("m05").await.unwrap());
    let second = q.dead_letters(first.next.as_ref(), 10).await.unwrap();
    let expected: Vec<String> = (10..20).map(|i| format!("m{i:02}")).collect();
    assert_eq!(ids(&second.letters), expected);
    // A cursor printed and parsed is the same place.
    let cursor = first.next.unwrap();
    assert_eq!(cursor.to_string().parse::<DeadCursor>().unwrap(), cursor);
    assert!(cursor.to_string().ends_with("-m09"), "{cursor}");
    assert!("m09".parse::<DeadCursor>().is_err());
    assert!("12-".parse::<DeadCursor>().is_err());
    // A cursor past every letter: an empty last page.
    let past = DeadCursor::new(i64::MAX / 2, "z");
    let page = q.dead_letters(Some(&past), 10).await.unwrap();
    assert!(page.letters.is_empty() && page.next.is_none());
}

/// Keyed letters with the same ids (with a backslash) under two keys of
/// one partition, buried two at a time: paged each once, and each
/// page's cursor the same place once printed and parsed (a keyed letter's
/// cursor holds its key, a NUL and its id; printed with `\0` and `\\`).
#[tokio::test]
async fn keyed_letters_with_one_id_under_two_keys_are_paged_each_once() {
    let server = server();
    let q: Queue<u64> = Queue::new(manager(&server).await, "keyed").unwrap();
    let slot = |k: &str| crc16::State::<crc16::XMODEM>::calculate(k.as_bytes()) % 16_384;
    let near = (0..)
        .map(|i| format!("b{i}"))
        .find(|k| slot(k) == slot("a"));
    let keys = ["a".to_owned(), near.unwrap()];
    // Each key's line is claimed one message at a time: 6 rounds of 2.
    for i in 0..6u64 {
        for key in &keys {
            let options = PushOptions::new().id(format!("m\\{i}")).key(key);
            q.push_with(i, options).await.unwrap();
        }
    }
    for _ in 0..6 {
        let jobs = q.claim(10, secs(30)).await.unwrap().jobs;
        assert_eq!(jobs.len(), 2);
        for job in &jobs {
            assert!(q.bury(job, "failed").await.unwrap());
        }
    }
    let mut after = None;
    let mut seen = BTreeSet::new();
    loop {
        let page = q.dead_letters(after.as_ref(), 5).await.unwrap();
        for letter in &page.letters {
            let key = letter.key.clone().expect("a keyed letter's key");
            assert!(seen.insert((key, letter.id.clone())), "{letter:?} twice");
        }
        let Some(next) = page.next else { break };
        let text = next.to_string();
        assert!(!text.contains('\0'), "{text:?}");
        assert_eq!(text.parse::<DeadCursor>().unwrap(), next);
        after = Some(text.parse().unwrap());
    }
    assert_eq!(seen.len(), 12, "{seen:?}");
}
