//! `lockgate dashboard`: queues, dead letters, locks and live rates in the
//! browser.
//!
//! Server-rendered HTML (maud escapes everything it is given, so a payload
//! or an error text from Redis renders as text), one small script of our
//! own that refreshes the live parts, a stylesheet; both embedded, so the
//! binary is all it takes. Reads go through lockgate's public API. Mutations
//! are POSTs carrying a per-process CSRF token; GETs change nothing. A
//! request sent to a name that is not the dashboard's is refused first of
//! all (DNS rebinding: `hosts`). On a non-loopback address a token is
//! required, asked for once (`/login`), which opens a session kept in an
//! HttpOnly cookie (`sessions`).

mod hosts;
mod sessions;

pub(crate) use hosts::Authority;
pub(crate) use sessions::Sessions;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use axum::Router;
use axum::extract::{Form, Path, Query, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use lockgate::queue::{DeadCursor, DeadLetter, KeyLoad, Peeked, Stats};
use lockgate::{Locker, Queue};
use maud::{DOCTYPE, Markup, html};
use redis::aio::{ConnectionLike, ConnectionManager};
use serde::Deserialize;
use serde_json::Value;

/// How long a list of queue names is reused before it is read again.
const DISCOVERY_TTL: Duration = Duration::from_secs(10);
/// Dead letters per page.
const PAGE: usize = 25;
/// Waiting and active messages shown per queue page.
const PEEK: usize = 20;
/// Payloads longer than this are folded.
const FOLD: usize = 400;
/// The live chart: buckets of this many seconds, over this many buckets.
const BUCKET_SECS: u64 = 10;
const BUCKETS: u64 = 30;

/// How long a login lasts.
pub(crate) const SESSION_LIFETIME: Duration = Duration::from_secs(12 * 60 * 60);
/// The cookie that holds a login's session id.
const SESSION_COOKIE: &str = "lockgate_session";

const SCRIPT: &str = include_str!("dashboard/app.js");
const STYLE: &str = include_str!("dashboard/style.css");

/// What the dashboard serves from.
pub(crate) struct Dashboard<C> {
    /// The server's (or the cluster's) connection.
    pub(crate) conn: C,
    /// On a cluster, a connection to each master, for the listings.
    pub(crate) nodes: Vec<ConnectionManager>,
    pub(crate) prefix: String,
    /// Where to listen; once listening, the address bound (a port 0 is
    /// known only then), which the `Host` rule compares with.
    pub(crate) bind: SocketAddr,
    /// Names the dashboard answers to besides its own (`--allowed-host`).
    pub(crate) allowed_hosts: Vec<Authority>,
    /// Required (once, at `/login`) when set.
    pub(crate) token: Option<String>,
    /// The logins made with the token.
    pub(crate) sessions: Sessions,
    /// The per-process CSRF token every form carries.
    pub(crate) csrf: String,
    /// Discovered queue names, and when.
    pub(crate) names: Mutex<Option<(Instant, Vec<String>)>>,
}

type Shared<C> = Arc<Dashboard<C>>;

/// Serves the dashboard on its `bind` address until Ctrl-C.
pub(crate) async fn serve<C>(mut dashboard: Dashboard<C>) -> std::io::Result<()>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    let listener = tokio::net::TcpListener::bind(dashboard.bind).await?;
    dashboard.bind = listener.local_addr()?;
    crate::say!("lockgate dashboard on http://{}/", dashboard.bind);
    let shared = Arc::new(dashboard);
    let app = Router::new()
        .route("/", get(overview::<C>))
        .route("/fragment/overview", get(overview_fragment::<C>))
        .route("/queue/{name}", get(queue_page::<C>))
        .route("/fragment/queue/{name}", get(queue_fragment::<C>))
        .route("/queue/{name}/requeue", post(requeue::<C>))
        .route("/queue/{name}/remove", post(remove::<C>))
        .route("/queue/{name}/purge", post(purge::<C>))
        .route("/locks", get(locks::<C>))
        .route("/login", get(login::<C>))
        .route(
            "/assets/app.js",
            get(|| async { asset(SCRIPT, "text/javascript") }),
        )
        .route(
            "/assets/style.css",
            get(|| async { asset(STYLE, "text/css") }),
        )
        .layer(middleware::from_fn_with_state(shared.clone(), guard::<C>))
        .with_state(shared);
    axum::serve(listener, app)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await
}

fn asset(body: &'static str, kind: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, kind),
            (header::CACHE_CONTROL, "max-age=300"),
        ],
        body,
    )
        .into_response()
}

/// Every request passes here first. A request sent to a name that is not
/// the dashboard's is refused before anything else: before the login and
/// the assets, and before any Redis call. Then the login, when a token is
/// required. Every answer, refusals too, gets the security headers.
async fn guard<C>(State(d): State<Shared<C>>, request: Request, next: Next) -> Response
where
    C: Send + Sync + 'static,
{
    let mut response = match d.refused_host(&request) {
        Some(host) => misdirected(&host, d.bind),
        None if !d.logged_in(&request) => token_required(&d.sessions),
        None => next.run(request).await,
    };
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
        ),
    );
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    // No referrer beyond the dashboard. Not `no-referrer`: under it a
    // browser sends `Origin: null` with the dashboard's own form POSTs,
    // which `allowed` refuses.
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("same-origin"),
    );
    response
}

impl<C> Dashboard<C> {
    /// The name a request was sent to, quoted, when it is not one of the
    /// dashboard's (`hosts::host_allowed`); `None` when it is. Both names
    /// a request may give are checked: its `Host` header, and the target's
    /// authority when the request line is in absolute form (a client that
    /// means the dashboard gives its name in both). HTTP/1.1 requires
    /// exactly one `Host`: none, or several, is refused too.
    fn refused_host(&self, request: &Request) -> Option<String> {
        let mut values = request.headers().get_all(header::HOST).iter();
        let host = match (values.next(), values.next()) {
            (Some(host), None) => String::from_utf8_lossy(host.as_bytes()).into_owned(),
            (None, _) => return Some("(none)".into()),
            (Some(_), Some(_)) => return Some("(several)".into()),
        };
        let target = request.uri().authority().map(|a| a.as_str().to_owned());
        [Some(host), target]
            .into_iter()
            .flatten()
            .find(|name| !hosts::host_allowed(name, self.bind, &self.allowed_hosts))
            .map(|name| format!("{name:?}"))
    }

    /// Whether a request may go on: no token is required, it is the login
    /// or an asset, or it carries a live session.
    fn logged_in(&self, request: &Request) -> bool {
        let path = request.uri().path();
        let open = path == "/login" || path.starts_with("/assets/");
        self.token.is_none()
            || open
            || cookie(request.headers(), SESSION_COOKIE).is_some_and(|id| self.sessions.valid(id))
    }
}

/// 421 Misdirected Request: the request was meant for another name. Plain
/// text, so that the name it repeats cannot be markup.
fn misdirected(host: &str, bind: SocketAddr) -> Response {
    let port = bind.port();
    let body = format!(
        "Refused: this request was sent to Host {host}, not to a name of this dashboard.\n\
         It answers to localhost:{port}, 127.0.0.1:{port} and [::1]:{port}, to its own \
         address, and to the names it is given with --allowed-host NAME (or \
         LOCKGATE_DASHBOARD_ALLOWED_HOSTS=NAME,NAME). If browsers reach it by this name \
         (a DNS name, a reverse proxy), start it with --allowed-host and that name.\n"
    );
    (
        StatusCode::MISDIRECTED_REQUEST,
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        body,
    )
        .into_response()
}

/// 401: the page that asks for the token.
fn token_required(sessions: &Sessions) -> Response {
    let hours = sessions.lifetime().as_secs() / 3600;
    let page = layout(
        "Token required",
        html! {
            h1 { "Token required" }
            p { "This dashboard asks for its token. Open "
                code { "/login?token=<token>" } " once; a cookie keeps you logged in for "
                (hours) " hours." }
        },
    );
    (StatusCode::UNAUTHORIZED, page).into_response()
}

/// Constant-time comparison of two secrets.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn cookie<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v)
}

#[derive(Deserialize)]
struct LoginQuery {
    token: String,
}

async fn login<C>(State(d): State<Shared<C>>, Query(q): Query<LoginQuery>) -> Response {
    match &d.token {
        Some(token) if same(q.token.as_bytes(), token.as_bytes()) => {
            // A session id, never the token itself: a cookie that leaks
            // opens one session, which ends by itself.
            let cookie = format!(
                "{SESSION_COOKIE}={}; HttpOnly; SameSite=Strict; Path=/; Max-Age={}",
                d.sessions.open(),
                d.sessions.lifetime().as_secs()
            );
            let mut response = Redirect::to("/").into_response();
            if let Ok(value) = HeaderValue::from_str(&cookie) {
                response.headers_mut().insert(header::SET_COOKIE, value);
            }
            response
        }
        Some(_) => (StatusCode::UNAUTHORIZED, "wrong token").into_response(),
        None => Redirect::to("/").into_response(),
    }
}

// ---------------------------------------------------------------------------
// Pages

fn layout(title: &str, body: Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) " · lockgate" }
                link rel="stylesheet" href="/assets/style.css";
                script src="/assets/app.js" defer {}
            }
            body {
                nav {
                    a href="/" { "lockgate" }
                    a href="/" { "Queues" }
                    a href="/locks" { "Locks" }
                }
                main { (body) }
            }
        }
    }
}

/// A page that could not reach Redis: says so, and the script retries.
fn unreachable(error: &lockgate::Error) -> Response {
    let page = layout(
        "Redis unreachable",
        html! {
            h1 { "Redis is unreachable" }
            p.error { (error) }
            p { "Retrying every few seconds." }
            div data-refresh="/" data-reload="1" {}
        },
    );
    (StatusCode::SERVICE_UNAVAILABLE, page).into_response()
}

impl<C> Dashboard<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    async fn queue(&self, name: &str) -> lockgate::Result<Queue<Value, C>> {
        let queue = Queue::new(self.conn.clone(), name)?.prefix(&self.prefix)?;
        queue.with_recorded_shards().await
    }

    /// The queues under the prefix (`queue_names`), read at most every
    /// `DISCOVERY_TTL`.
    async fn names(&self) -> lockgate::Result<Vec<String>> {
        if let Ok(cache) = self.names.lock()
            && let Some((at, names)) = cache.as_ref()
            && at.elapsed() < DISCOVERY_TTL
        {
            return Ok(names.clone());
        }
        let names = lockgate::queue::queue_names(&self.conn, &self.prefix).await?;
        if let Ok(mut cache) = self.names.lock() {
            *cache = Some((Instant::now(), names.clone()));
        }
        Ok(names)
    }
}

/// A queue's numbers for the overview: its stats and its recent rates.
struct Row {
    name: String,
    stats: Stats,
    rates: Option<Rates>,
}

/// Rates from the lifecycle events of the last minutes (when recorded).
struct Rates {
    done_per_sec: f64,
    failed_per_sec: f64,
    /// Done per bucket, oldest first.
    buckets: Vec<u64>,
}

/// A queue's row: its stats and rates in one round trip.
async fn row<C>(queue: &Queue<Value, C>, name: String) -> lockgate::Result<Row>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    let activity = queue
        .activity(Duration::from_secs(BUCKET_SECS * BUCKETS), BUCKETS as u32)
        .await?;
    // Rates over the last minute: the last buckets.
    let last = (60 / BUCKET_SECS) as usize;
    let recent = |counts: &[u64]| counts.iter().rev().take(last).sum::<u64>() as f64 / 60.0;
    let rates = activity.recorded.then(|| Rates {
        done_per_sec: recent(&activity.done),
        failed_per_sec: recent(&activity.failed),
        buckets: activity.done.clone(),
    });
    Ok(Row {
        name,
        stats: activity.stats,
        rates,
    })
}

async fn rows<C>(d: &Dashboard<C>) -> lockgate::Result<Vec<Row>>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    let mut rows = Vec::new();
    for name in d.names().await? {
        let queue = d.queue(&name).await?;
        rows.push(row(&queue, name).await?);
    }
    Ok(rows)
}

async fn overview<C>(State(d): State<Shared<C>>) -> Response
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    match rows(&d).await {
        Ok(rows) => layout(
            "Queues",
            html! {
                h1 { "Queues" }
                div id="live" data-refresh="/fragment/overview" { (overview_table(&rows)) }
            },
        )
        .into_response(),
        Err(e) => unreachable(&e),
    }
}

async fn overview_fragment<C>(State(d): State<Shared<C>>) -> Response
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    match rows(&d).await {
        Ok(rows) => overview_table(&rows).into_response(),
        Err(e) => (
            StatusCode::SERVICE_UNAVAILABLE,
            html! { p.error { "Redis is unreachable: " (e) } },
        )
            .into_response(),
    }
}

fn overview_table(rows: &[Row]) -> Markup {
    html! {
        @if rows.is_empty() {
            p { "No queues under this prefix yet." }
        } @else {
            table.queues {
                thead { tr {
                    th { "queue" } th.n { "due" } th.n { "later" } th.n { "active" } th.n { "dead" }
                    th.n { "done/s" } th.n { "failed/s" } th { "oldest due" } th { "done, last 5 min" }
                } }
                tbody {
                    @for row in rows {
                        tr data-queue=(row.name) {
                            td { a href=(format!("/queue/{}", encode(&row.name))) { (row.name) } }
                            td.n.due { (row.stats.due) }
                            td.n { (row.stats.later) }
                            td.n { (row.stats.active) }
                            td.n.dead { (row.stats.dead) }
                            @match &row.rates {
                                Some(r) => {
                                    td.n { (format!("{:.1}", r.done_per_sec)) }
                                    td.n { (format!("{:.1}", r.failed_per_sec)) }
                                }
                                None => { td.n.muted title="record_events is off" { "–" } td.n.muted { "–" } }
                            }
                            td { (age(row.stats.oldest_due_age)) }
                            td { @if let Some(r) = &row.rates { (sparkline(&r.buckets)) } @else { span.muted { "events off" } } }
                        }
                    }
                }
            }
        }
    }
}

fn age(age: Option<Duration>) -> String {
    match age {
        None => "–".into(),
        Some(d) if d < Duration::from_secs(1) => format!("{} ms", d.as_millis()),
        Some(d) => humantime::format_duration(Duration::from_secs(d.as_secs())).to_string(),
    }
}

/// A small line chart of `values`, as inline SVG.
fn sparkline(values: &[u64]) -> Markup {
    let (w, h) = (150.0, 28.0);
    let max = values.iter().copied().max().unwrap_or(0).max(1) as f64;
    let step = w / (values.len().max(2) - 1) as f64;
    let points: Vec<String> = values
        .iter()
        .enumerate()
        .map(|(i, v)| {
            format!(
                "{:.1},{:.1}",
                i as f64 * step,
                h - 2.0 - (*v as f64 / max) * (h - 4.0)
            )
        })
        .collect();
    html! {
        svg.spark width=(w) height=(h) viewBox=(format!("0 0 {w} {h}")) role="img" aria-label="done per 10 s" {
            polyline points=(points.join(" ")) {}
        }
    }
}

/// Percent-encodes a path segment.
fn encode(segment: &str) -> String {
    segment
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

#[derive(Deserialize, Default)]
struct QueueQuery {
    /// The dead-letter page shown: the one after this cursor (`<buried
    /// ms>-<id>`); the first page without it.
    after: Option<String>,
    notice: Option<String>,
}

impl QueueQuery {
    /// The dead-letter page's cursor (a malformed one shows the first page).
    fn cursor(&self) -> Option<DeadCursor> {
        self.after.as_deref().and_then(|after| after.parse().ok())
    }
}

/// The query that shows the dead-letter page after `cursor`.
fn after_query(cursor: Option<&DeadCursor>) -> String {
    cursor.map_or(String::new(), |c| {
        format!("?after={}", encode(&c.to_string()))
    })
}

async fn queue_page<C>(
    State(d): State<Shared<C>>,
    Path(name): Path<String>,
    Query(q): Query<QueueQuery>,
) -> Response
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    let cursor = q.cursor();
    let body = match queue_body(&d, &name, cursor.as_ref()).await {
        Ok(Some(body)) => body,
        Ok(None) => {
            let page = layout(
                "Not found",
                html! { h1 { "No queue " code { (name) } } p { a href="/" { "All queues" } } },
            );
            return (StatusCode::NOT_FOUND, page).into_response();
        }
        Err(e) => return unreachable(&e),
    };
    // The refresh reads the page shown, and only it.
    let path = format!(
        "/fragment/queue/{}{}",
        encode(&name),
        after_query(cursor.as_ref())
    );
    layout(
        &name,
        html! {
            h1 { "Queue " code { (name) } }
            @if let Some(notice) = &q.notice { p.notice { (notice) } }
            div id="live" data-refresh=(path) { (body) }
            (actions(&d, &name))
        },
    )
    .into_response()
}

async fn queue_fragment<C>(
    State(d): State<Shared<C>>,
    Path(name): Path<String>,
    Query(q): Query<QueueQuery>,
) -> Response
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    match queue_body(&d, &name, q.cursor().as_ref()).await {
        Ok(Some(body)) => body.into_response(),
        Ok(None) => (StatusCode::NOT_FOUND, html! { p { "The queue is gone." } }).into_response(),
        Err(e) => (
            StatusCode::SERVICE_UNAVAILABLE,
            html! { p.error { "Redis is unreachable: " (e) } },
        )
            .into_response(),
    }
}

/// The live part of a queue's page; `None` when the queue does not exist.
async fn queue_body<C>(
    d: &Dashboard<C>,
    name: &str,
    after: Option<&DeadCursor>,
) -> lockgate::Result<Option<Markup>>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    let queue = d.queue(name).await?;
    if !queue.exists().await? {
        return Ok(None);
    }
    let (stats, shards) = match queue.shard_count() {
        1 => (queue.stats().await?, Vec::new()),
        _ => queue.stats_by_shard().await?,
    };
    let keys = queue.key_stats(PEEK).await?;
    let peek = queue.peek(PEEK).await?;
    let dead = queue.dead_letters(after, PAGE).await?;
    let now = SystemTime::now();
    Ok(Some(html! {
        table.stats { tr {
            td { "due " b.due { (stats.due) } }
            td { "later " b { (stats.later) } }
            td { "active " b { (stats.active) } }
            td { "dead " b.dead { (stats.dead) } }
            td { "oldest due " b { (age(stats.oldest_due_age)) } }
        } }
        @if !shards.is_empty() {
            h2 { "Shards" }
            p.muted { (shards.len()) " shards of the messages without a key." }
            table.shards {
                thead { tr { th { "shard" } th.n { "due" } th.n { "later" } th.n { "active" } th.n { "dead" } th { "oldest due" } } }
                tbody {
                    @for (i, shard) in shards.iter().enumerate() {
                        tr {
                            td { "shard " (i) }
                            td.n { (shard.due) }
                            td.n { (shard.later) }
                            td.n { (shard.active) }
                            td.n { (shard.dead) }
                            td { (age(shard.oldest_due_age)) }
                        }
                    }
                }
            }
        }
        @if keys.keys > 0 {
            h2 { "Keys" }
            p.muted { (keys.keys) " keys with messages in line or at work." }
            h3 { "Busy keys" }
            (key_table(&keys.busy, "busy"))
            h3 { "Longest lines" }
            (key_table(&keys.backlogs, "lines"))
        }
        h2 { "Next waiting" }
        (message_table(&peek.waiting, "due", now, None))
        h2 { "Active" }
        (message_table(&peek.active, "lease ends", now, None))
        h2 id="dead" { "Dead letters" }
        @if dead.letters.is_empty() && after.is_none() {
            p.muted { "None." }
        } @else {
            (dead_table(d, name, &dead.letters))
            p.pager {
                @if after.is_some() {
                    a.first href=(format!("/queue/{}#dead", encode(name))) { "← first page" }
                }
                " " (dead.letters.len()) " shown of " (stats.dead) ", oldest first "
                @if let Some(next) = &dead.next {
                    a.next href=(format!("/queue/{}{}#dead", encode(name), after_query(Some(next)))) { "next page →" }
                }
            }
        }
    }))
}

/// Keys of a keyed queue: at work, in line, and how long the first in line
/// has waited.
fn key_table(loads: &[KeyLoad], class: &str) -> Markup {
    html! {
        @if loads.is_empty() {
            p.muted { "None." }
        } @else {
            table.keys.(class) {
                thead { tr { th { "key" } th.n { "at work" } th.n { "in line" } th { "first in line waiting" } } }
                tbody {
                    @for load in loads {
                        tr {
                            td { code { (load.key) } }
                            td.n { (load.at_work) }
                            td.n { (load.waiting) }
                            td { (age(load.oldest_waiting)) }
                        }
                    }
                }
            }
        }
    }
}

fn message_table(messages: &[Peeked], when: &str, now: SystemTime, _: Option<()>) -> Markup {
    html! {
        @if messages.is_empty() {
            p.muted { "None." }
        } @else {
            @let keyed = messages.iter().any(|m| m.key.is_some());
            table.messages {
                thead { tr { th { "id" } @if keyed { th { "key" } } th { (when) } th.n { "priority" } th.n { "attempts" } th.n { "deferrals" } th { "payload" } } }
                tbody {
                    @for m in messages {
                        tr {
                            td { code { (m.id) } }
                            @if keyed { td.key { @if let Some(key) = &m.key { code { (key) } } } }
                            td { (relative(m.at, now)) }
                            td.n { (m.priority) }
                            td.n { (m.failures + 1) }
                            td.n { (m.deferrals) }
                            td { (payload(&m.payload)) }
                        }
                    }
                }
            }
        }
    }
}

fn relative(at: SystemTime, now: SystemTime) -> String {
    match at.duration_since(now) {
        Ok(ahead) => format!(
            "in {}",
            humantime::format_duration(Duration::from_millis(ahead.as_millis() as u64))
        ),
        Err(past) => format!(
            "{} ago",
            humantime::format_duration(Duration::from_millis(past.duration().as_millis() as u64))
        ),
    }
}

/// A payload as pretty JSON (or as text when it is not JSON), escaped, long
/// ones folded.
fn payload(bytes: &[u8]) -> Markup {
    let text = match serde_json::from_slice::<Value>(bytes) {
        Ok(value) => serde_json::to_string_pretty(&value).unwrap_or_default(),
        Err(_) => String::from_utf8_lossy(bytes).into_owned(),
    };
    html! {
        @if text.len() > FOLD {
            details { summary { (format!("{} bytes", bytes.len())) } pre { (text) } }
        } @else {
            pre { (text) }
        }
    }
}

fn dead_table<C>(d: &Dashboard<C>, name: &str, dead: &[DeadLetter]) -> Markup {
    html! {
        table.dead {
            thead { tr { th { "id" } th { "buried" } th.n { "attempts" } th { "error" } th { "payload" } th {} } }
            tbody {
                @for letter in dead {
                    tr data-id=(letter.id) {
                        td { code { (letter.id) } }
                        td { (relative(letter.buried_at, SystemTime::now())) }
                        td.n { (letter.failures) }
                        td.error { (letter.error.as_deref().unwrap_or("")) }
                        td { (payload(&letter.payload)) }
                        td.actions {
                            form method="post" action=(format!("/queue/{}/requeue", encode(name))) {
                                input type="hidden" name="csrf" value=(d.csrf);
                                input type="hidden" name="id" value=(letter.id);
                                button.requeue type="submit" { "Requeue" }
                            }
                            form method="post" action=(format!("/queue/{}/remove", encode(name))) {
                                input type="hidden" name="csrf" value=(d.csrf);
                                input type="hidden" name="id" value=(letter.id);
                                button.remove type="submit" data-confirm="Delete this message?" { "Remove" }
                            }
                        }
                    }
                }
            }
        }
    }
}

fn actions<C>(d: &Dashboard<C>, name: &str) -> Markup {
    html! {
        h2 { "Actions" }
        div.actions {
            form method="post" action=(format!("/queue/{}/requeue", encode(name))) {
                input type="hidden" name="csrf" value=(d.csrf);
                input type="hidden" name="all" value="1";
                button id="requeue-all" type="submit" { "Requeue all dead letters" }
            }
            form method="post" action=(format!("/queue/{}/purge", encode(name))) {
                input type="hidden" name="csrf" value=(d.csrf);
                label { "Type the queue's name to purge it: " input type="text" name="confirm" autocomplete="off"; }
                button.danger type="submit" { "Purge" }
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Actions

#[derive(Deserialize)]
struct ActionForm {
    csrf: String,
    id: Option<String>,
    all: Option<String>,
    confirm: Option<String>,
}

/// Whether a POST may act: the page's CSRF token, and not from another site
/// as the browser tells: `Sec-Fetch-Site`, and `Origin` (sent on POSTs also
/// by browsers without the former), which must name the dashboard as a
/// `Host` must. An opaque `Origin: null` is refused: the dashboard's own
/// forms never send it.
fn allowed<C>(d: &Dashboard<C>, headers: &HeaderMap, form: &ActionForm) -> bool {
    let cross_site = headers
        .get("sec-fetch-site")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v == "cross-site");
    let foreign_origin = headers.get(header::ORIGIN).is_some_and(|origin| {
        let authority = origin.to_str().ok().and_then(|o| {
            o.strip_prefix("http://")
                .or_else(|| o.strip_prefix("https://"))
        });
        !authority.is_some_and(|a| hosts::host_allowed(a, d.bind, &d.allowed_hosts))
    });
    !cross_site && !foreign_origin && same(form.csrf.as_bytes(), d.csrf.as_bytes())
}

fn forbidden() -> Response {
    (
        StatusCode::FORBIDDEN,
        layout("Refused", html! { h1 { "Refused" } p { "This action needs the page's form token. Reload the page and try again." } }),
    )
        .into_response()
}

fn back(name: &str, notice: &str) -> Response {
    let notice: String = notice
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect();
    Redirect::to(&format!("/queue/{}?notice={notice}", encode(name))).into_response()
}

async fn requeue<C>(
    State(d): State<Shared<C>>,
    Path(name): Path<String>,
    headers: HeaderMap,
    Form(form): Form<ActionForm>,
) -> Response
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    if !allowed(&d, &headers, &form) {
        return forbidden();
    }
    let result = async {
        let queue = d.queue(&name).await?;
        match (&form.id, form.all.as_deref()) {
            (_, Some("1")) => Ok(format!(
                "re-drove {} dead letters",
                queue.requeue_all_dead().await?
            )),
            (Some(id), _) if queue.requeue_dead(id).await? => Ok(format!("re-drove {id}")),
            (Some(id), _) => Ok(format!("{id} is not a dead letter (any more)")),
            (None, _) => Ok("nothing to re-drive".to_owned()),
        }
    };
    match result.await {
        Ok(notice) => back(&name, &notice),
        Err(e) => unreachable(&e),
    }
}

async fn remove<C>(
    State(d): State<Shared<C>>,
    Path(name): Path<String>,
    headers: HeaderMap,
    Form(form): Form<ActionForm>,
) -> Response
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    if !allowed(&d, &headers, &form) {
        return forbidden();
    }
    let Some(id) = form.id.clone() else {
        return back(&name, "no message given");
    };
    match d.queue(&name).await {
        Ok(queue) => match queue.remove(&id).await {
            Ok(true) => back(&name, &format!("removed {id}")),
            Ok(false) => back(&name, &format!("{id} is not waiting or dead (any more)")),
            Err(e) => unreachable(&e),
        },
        Err(e) => unreachable(&e),
    }
}

async fn purge<C>(
    State(d): State<Shared<C>>,
    Path(name): Path<String>,
    headers: HeaderMap,
    Form(form): Form<ActionForm>,
) -> Response
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    if !allowed(&d, &headers, &form) {
        return forbidden();
    }
    if form.confirm.as_deref() != Some(name.as_str()) {
        return back(&name, "not purged: type the queue's name to confirm");
    }
    match d.queue(&name).await {
        Ok(queue) => match queue.purge().await {
            Ok(()) => {
                if let Ok(mut cache) = d.names.lock() {
                    *cache = None;
                }
                Redirect::to("/").into_response()
            }
            Err(e) => unreachable(&e),
        },
        Err(e) => unreachable(&e),
    }
}

// ---------------------------------------------------------------------------
// Locks

#[derive(Deserialize)]
struct LocksQuery {
    #[serde(rename = "match")]
    pattern: Option<String>,
}

async fn locks<C>(State(d): State<Shared<C>>, Query(q): Query<LocksQuery>) -> Response
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    let pattern = q
        .pattern
        .filter(|p| !p.is_empty())
        .unwrap_or_else(|| "*".into());
    let listed = async {
        let mut locks = Vec::new();
        let mut permits = BTreeMap::new();
        let conns: Vec<Locker<C>> = if d.nodes.is_empty() {
            vec![Locker::new(d.conn.clone()).prefix(&d.prefix)?]
        } else {
            Vec::new()
        };
        for locker in &conns {
            locks.extend(locker.held_locks(&pattern).await?);
            permits.extend(locker.held_permits(&pattern).await?);
        }
        for node in &d.nodes {
            let locker = Locker::new(node.clone()).prefix(&d.prefix)?;
            locks.extend(locker.held_locks(&pattern).await?);
            permits.extend(locker.held_permits(&pattern).await?);
        }
        locks.sort_by(|a, b| a.0.cmp(&b.0));
        Ok::<_, lockgate::Error>((locks, permits))
    };
    let (locks, permits) = match listed.await {
        Ok(listed) => listed,
        Err(e) => return unreachable(&e),
    };
    layout(
        "Locks",
        html! {
            h1 { "Locks" }
            form.search method="get" action="/locks" {
                input type="search" name="match" value=(pattern) placeholder="order:*";
                button type="submit" { "Search" }
            }
            h2 { "Held locks" }
            @if locks.is_empty() { p.muted { "None match." } } @else {
                table.locks {
                    thead { tr { th { "key" } th.n { "fence" } th { "remaining" } th { "holder" } } }
                    tbody {
                        @for (key, holder) in &locks {
                            tr {
                                td { code { (key) } }
                                td.n { (holder.fence.map_or("–".to_owned(), |f| f.to_string())) }
                                td { (holder.remaining.map_or("no expiry".to_owned(), |r| format!("{} ms", r.as_millis()))) }
                                td { code.token { (holder.token) } }
                            }
                        }
                    }
                }
            }
            h2 { "Permits" }
            @if permits.is_empty() { p.muted { "None match." } } @else {
                table.locks {
                    thead { tr { th { "key" } th.n { "holders" } th { "leases" } } }
                    tbody {
                        @for (key, holders) in &permits {
                            tr {
                                td { code { (key) } }
                                td.n { (holders.len()) }
                                td {
                                    @for h in holders {
                                        span.lease { "fence " (h.fence.map_or("–".to_owned(), |f| f.to_string())) ", " (h.remaining.as_millis()) " ms" }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        },
    )
    .into_response()
}
