//! The dashboard in a real browser: headless Chromium driven through
//! WebDriver (chromedriver). Open the overview, click into a queue, requeue
//! a dead letter, see the counts change. A screenshot of each page goes to
//! `target/dashboard-screenshots/`.
//!
//! Needs Debian's `chromium` and `chromium-driver` (`.ci/run` installs them);
//! without them the test fails and says so.

mod web;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use fantoccini::elements::Element;
use fantoccini::error::CmdError;
use fantoccini::{Client, ClientBuilder, Locator};
use lockgate::testing::RedisServer;
use lockgate::{PushOptions, Queue};
use serde_json::json;

const CHROMIUM: &str = "/usr/bin/chromium";
const DRIVER: &str = "chromedriver";

/// A chromedriver process on a free port, killed on drop.
struct Driver(Child, u16);

impl Driver {
    fn start() -> Self {
        assert!(
            std::path::Path::new(CHROMIUM).exists(),
            "{CHROMIUM} is missing: the browser test needs Chromium and its WebDriver \
             (`sudo apt-get install chromium chromium-driver` on Debian/Ubuntu)"
        );
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .unwrap();
        let child = Command::new(DRIVER)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "could not run `{DRIVER}` ({e}): the browser test needs Chromium's WebDriver \
                     (`sudo apt-get install chromium-driver` on Debian/Ubuntu)"
                )
            });
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                std::time::Instant::now() < deadline,
                "chromedriver did not start"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        Driver(child, port)
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Finds the element `css` selects and applies `read` to it. The pages'
/// live parts replace their elements on every refresh, so an element found
/// can be gone before it is read: then it is found again.
async fn with<T, F, Fut>(browser: &Client, css: &str, read: F) -> Result<T, CmdError>
where
    F: Fn(Element) -> Fut,
    Fut: std::future::Future<Output = Result<T, CmdError>>,
{
    let mut tries = 0;
    loop {
        let element = browser.find(Locator::Css(css)).await?;
        match read(element).await {
            Err(e) if e.is_stale_element_reference() && tries < 50 => tries += 1,
            done => return done,
        }
    }
}

async fn text(browser: &Client, css: &str) -> Result<String, CmdError> {
    with(browser, css, |e| async move { e.text().await }).await
}

async fn click(browser: &Client, css: &str) -> Result<(), CmdError> {
    with(browser, css, |e| async move { e.click().await.map(drop) }).await
}

fn screenshots() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/dashboard-screenshots");
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_is_requeued_from_the_browser() {
    let server = RedisServer::start().unwrap();
    let conn = server.connection_manager().await.unwrap();
    let q: Queue<serde_json::Value> = Queue::new(conn.clone(), "emails")
        .unwrap()
        .record_events(1000)
        .unwrap();
    for n in 0..6 {
        q.push_with(
            json!({"to": format!("user{n}@example.com"), "template": "welcome"}),
            PushOptions::new().id(format!("mail-{n}")),
        )
        .await
        .unwrap();
    }
    for job in q.claim(3, Duration::from_secs(30)).await.unwrap().jobs {
        if job.id() == "mail-0" {
            q.bury(&job, "SMTP 550: mailbox unavailable").await.unwrap();
        } else {
            q.ack(&job).await.unwrap();
        }
    }
    let other: Queue<serde_json::Value> = Queue::new(conn.clone(), "invoices").unwrap();
    other.push(json!({"invoice": 7})).await.unwrap();

    // A live worker on a third queue, with a producer feeding it: the
    // overview's rates and chart move.
    let orders: Queue<serde_json::Value> = Queue::new(conn, "orders")
        .unwrap()
        .record_events(10_000)
        .unwrap();
    let service = tower::service_fn(|job: lockgate::Job<serde_json::Value>| async move {
        tokio::time::sleep(Duration::from_millis(2)).await;
        if job["n"].as_u64().is_some_and(|n| n % 10 == 0) && job.attempt() == 1 {
            return Err::<(), lockgate::BoxError>("payment provider timed out".into());
        }
        Ok(())
    });
    let backoff =
        lockgate::Backoff::exponential(Duration::from_millis(200), Duration::from_secs(1));
    let worker = lockgate::Worker::new(server.client(), orders.clone(), service)
        .concurrency(8)
        .unwrap()
        .retry_backoff(backoff.unwrap());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let working = tokio::spawn(worker.run_until(async { drop(stopped.await) }));
    let producing = tokio::spawn(async move {
        for n in 0u64.. {
            let batch: Vec<_> = (0..20)
                .map(|i| json!({"n": n * 20 + i, "total": 42}))
                .collect();
            if orders.push_many(&batch).await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    tokio::time::sleep(Duration::from_secs(3)).await;

    let board = web::Dashboard::start(&server, &[]);
    let driver = Driver::start();
    let profile = std::env::temp_dir().join(format!("lockgate-chromium-{}", std::process::id()));
    let capabilities = json!({
        "goog:chromeOptions": {
            "binary": CHROMIUM,
            "args": [
                "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--no-first-run", "--disable-background-networking", "--disable-component-update",
                "--disable-sync", "--window-size=1280,800",
                format!("--user-data-dir={}", profile.display()),
            ]
        }
    });
    let capabilities = match capabilities {
        serde_json::Value::Object(map) => map,
        _ => unreachable!(),
    };
    let browser = ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
        .capabilities(capabilities)
        .connect(&format!("http://127.0.0.1:{}", driver.1))
        .await
        .expect("a Chromium session");
    let shots = screenshots();
    let result = async {
        // The overview lists both queues.
        browser.goto(&format!("{}/", board.base)).await?;
        browser
            .wait()
            .for_element(Locator::Css(r#"a[href="/queue/emails"]"#))
            .await?;
        browser
            .find(Locator::Css(r#"a[href="/queue/invoices"]"#))
            .await?;
        let chart = with(
            &browser,
            r#"tr[data-queue="orders"] svg.spark"#,
            |e| async move { e.html(false).await },
        );
        assert!(chart.await?.contains("polyline"));
        std::fs::write(shots.join("overview.png"), browser.screenshot().await?).unwrap();

        // Into the queue: one dead letter.
        click(&browser, r#"a[href="/queue/emails"]"#).await?;
        browser
            .wait()
            .for_element(Locator::Css("table.dead"))
            .await?;
        let dead = text(&browser, "b.dead").await?;
        assert_eq!(dead, "1");
        let error = text(&browser, "td.error").await?;
        assert!(error.contains("SMTP 550"), "{error}");
        std::fs::write(shots.join("queue.png"), browser.screenshot().await?).unwrap();

        // Requeue it: the page comes back with the counts changed.
        click(&browser, r#"tr[data-id="mail-0"] button.requeue"#).await?;
        browser.wait().for_element(Locator::Css("p.notice")).await?;
        let notice = text(&browser, "p.notice").await?;
        assert!(notice.contains("re-drove mail-0"), "{notice}");
        let dead = text(&browser, "b.dead").await?;
        assert_eq!(dead, "0");
        let due = text(&browser, "b.due").await?;
        assert_eq!(due, "4", "three waiting and the re-driven one");
        std::fs::write(shots.join("requeued.png"), browser.screenshot().await?).unwrap();

        // The live part refreshes by itself: a push shows up without a reload.
        q.push(json!({"to": "late@example.com"})).await.unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            let due = text(&browser, "b.due").await?;
            if due == "5" {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the page never refreshed: due {due}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }

        // Locks page.
        browser.goto(&format!("{}/locks", board.base)).await?;
        browser
            .wait()
            .for_element(Locator::Css("form.search"))
            .await?;
        std::fs::write(shots.join("locks.png"), browser.screenshot().await?).unwrap();
        Ok::<_, fantoccini::error::CmdError>(())
    }
    .await;
    let _ = browser.close().await;
    let _ = std::fs::remove_dir_all(&profile);
    producing.abort();
    let _ = stop.send(());
    let _ = working.await;
    result.expect("the browser walk-through");
}
