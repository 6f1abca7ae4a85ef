// lockgate dashboard: refreshes the live parts of a page without reloading
// it, and asks before destructive actions. Served from the binary; no build
// step, no third-party code.
"use strict";

const EVERY_MS = 2000;

function refresh(element) {
  const source = element.dataset.refresh;
  if (element.dataset.reload) {
    // A page that could not reach Redis: try the whole page again.
    setTimeout(() => window.location.reload(), EVERY_MS);
    return;
  }
  const tick = async () => {
    try {
      const response = await fetch(source, { headers: { "Accept": "text/html" } });
      if (response.ok || response.status === 503) {
        element.innerHTML = await response.text();
        element.classList.toggle("stale", !response.ok);
      }
    } catch (_) {
      element.classList.add("stale");
    }
    setTimeout(tick, EVERY_MS);
  };
  setTimeout(tick, EVERY_MS);
}

document.addEventListener("DOMContentLoaded", () => {
  document.querySelectorAll("[data-refresh]").forEach(refresh);
  document.addEventListener("submit", (event) => {
    const button = event.submitter;
    const question = button && button.dataset.confirm;
    if (question && !window.confirm(question)) event.preventDefault();
  });
});
