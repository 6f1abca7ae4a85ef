// GroupMQ on the hot-keys workload: `messages` messages over `keys` groups,
// all pushed before the workers start, handled by `workers` processes of
// `concurrency` each, every handler taking `min`..`max` ms. Prints one JSON
// line: throughput, how busy each key was, per-key order inversions, and
// Redis commands per message (INFO commandstats before and after).
//
//   node hot.mjs <redis url> <messages> <keys> <workers> <concurrency> <min ms> <max ms>
//
// bench/benches/groupmq.rs runs it (after `npm ci` here) beside lockgate.
import { spawn } from 'node:child_process';
import { fileURLToPath } from 'node:url';
import Redis from 'ioredis';
import { Queue, Worker } from 'groupmq';

const [url, messages, keys, workers, concurrency, min, max] = process.argv.slice(2);
const role = process.env.GROUPMQ_BENCH_ROLE ?? 'driver';
const namespace = 'hot';

if (role === 'worker') {
  await work();
} else {
  await drive();
}

// One worker process: handles until the queue is empty, then prints
// `group seq start end` per handled message (ms, wall clock).
async function work() {
  const redis = new Redis(url, { maxRetriesPerRequest: null });
  const queue = new Queue({ redis, namespace, jobTimeoutMs: 30_000 });
  const lines = [];
  const worker = new Worker({
    queue,
    concurrency: Number(concurrency),
    handler: async (job) => {
      const start = performance.timeOrigin + performance.now();
      // max 0: a no-op handler (a timer of 0 ms would still wait a tick).
      if (Number(max) > 0) {
        const ms = Number(min) + Math.random() * (Number(max) - Number(min));
        await new Promise((done) => setTimeout(done, ms));
      }
      const end = performance.timeOrigin + performance.now();
      lines.push(`${job.groupId} ${job.data.seq} ${start} ${end}`);
    },
  });
  worker.run();
  // Asked to stop by the driver once everything was handled.
  process.stdin.resume();
  await new Promise((done) => process.stdin.on('end', done));
  await worker.close(5_000);
  await queue.close();
  redis.disconnect();
  process.stdout.write(lines.join('\n') + '\n');
}

async function drive() {
  const redis = new Redis(url, { maxRetriesPerRequest: null });
  const queue = new Queue({ redis, namespace, jobTimeoutMs: 30_000 });
  const before = await commands(redis);
  for (let i = 0; i < Number(messages); i += 1000) {
    const batch = [];
    for (let n = i; n < Math.min(i + 1000, Number(messages)); n++) {
      batch.push(queue.add({ groupId: `k${n % Number(keys)}`, data: { seq: n }, orderMs: n }));
    }
    await Promise.all(batch);
  }
  const pushed = await commands(redis);
  const cpuBefore = await serverCpu(redis);
  const children = [];
  for (let w = 0; w < Number(workers); w++) {
    const child = spawn(process.execPath, [fileURLToPath(import.meta.url), ...process.argv.slice(2)], {
      env: { ...process.env, GROUPMQ_BENCH_ROLE: 'worker' },
      stdio: ['pipe', 'pipe', 'inherit'],
    });
    let out = '';
    child.stdout.on('data', (d) => (out += d));
    children.push({ child, done: new Promise((done) => child.on('close', () => done(out))) });
  }
  // Done when nothing waits and nothing runs.
  for (;;) {
    const counts = await queue.getJobCounts();
    if (counts.active + counts.waiting + counts.delayed === 0) break;
    await new Promise((done) => setTimeout(done, 20));
  }
  const after = await commands(redis);
  const cpuAfter = await serverCpu(redis);
  for (const { child } of children) child.stdin.end();
  const outs = await Promise.all(children.map(({ done }) => done));
  const handled = outs
    .join('')
    .split('\n')
    .filter(Boolean)
    .map((l) => l.split(' '))
    .map(([key, seq, start, end]) => ({ key, seq: Number(seq), start: Number(start), end: Number(end) }));
  await queue.close();
  redis.disconnect();
  console.log(JSON.stringify({ ...summary(handled), push_commands: pushed - before, commands: after - pushed, server_cpu: cpuAfter - cpuBefore }));
}

// The server's CPU time so far, user and system, in seconds (INFO cpu).
async function serverCpu(redis) {
  const info = await redis.info('cpu');
  const field = (name) => Number(info.match(new RegExp(`${name}:([0-9.]+)`))[1]);
  return field('used_cpu_user') + field('used_cpu_sys');
}

// Calls of every command so far (INFO commandstats).
async function commands(redis) {
  const info = await redis.info('commandstats');
  let total = 0;
  for (const m of info.matchAll(/calls=(\d+)/g)) total += Number(m[1]);
  return total;
}

function summary(handled) {
  const first = Math.min(...handled.map((h) => h.start));
  const last = Math.max(...handled.map((h) => h.end));
  const byKey = new Map();
  for (const h of handled) {
    if (!byKey.has(h.key)) byKey.set(h.key, []);
    byKey.get(h.key).push(h);
  }
  let inversions = 0;
  let overlaps = 0;
  const busy = [];
  const backlogged = [];
  for (const list of byKey.values()) {
    list.sort((a, b) => a.start - b.start);
    for (let i = 1; i < list.length; i++) {
      if (list[i].seq < list[i - 1].seq) inversions++;
      if (list[i].start < list[i - 1].end) overlaps++;
    }
    const handling = list.reduce((s, h) => s + (h.end - h.start), 0);
    busy.push(handling / (last - first));
    // Over the time the key had messages waiting: from the first start to
    // its own last end (all were pushed before the workers started).
    backlogged.push(handling / (Math.max(...list.map((h) => h.end)) - first));
  }
  const handlerMs = handled.reduce((s, h) => s + (h.end - h.start), 0) / handled.length;
  return {
    handled: handled.length,
    seconds: (last - first) / 1000,
    busy_min: Math.min(...busy),
    busy_mean: busy.reduce((s, b) => s + b, 0) / busy.length,
    backlogged_min: Math.min(...backlogged),
    backlogged_mean: backlogged.reduce((s, b) => s + b, 0) / backlogged.length,
    handler_ms: handlerMs,
    inversions,
    overlaps,
  };
}
