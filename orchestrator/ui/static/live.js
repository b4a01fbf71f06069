// dfo ui: keeps each section marked data-live="URL" fresh without reloading the page. Every data-every
// seconds (and once at load with data-now) it asks URL for the section's HTML, rendered and escaped by the
// server, and swaps it in when it changed. A failed request leaves the section as it was and says so.
"use strict";
(function () {
  var shown = new WeakMap();
  function refresh(section) {
    fetch(section.dataset.live, { credentials: "same-origin", cache: "no-store" })
      .then(function (response) {
        if (!response.ok) { throw new Error("HTTP " + response.status); }
        return response.text();
      })
      .then(function (html) {
        if (html !== shown.get(section)) {
          shown.set(section, html);
          section.innerHTML = html;
        }
        section.classList.remove("stale");
        section.removeAttribute("title");
      })
      .catch(function (error) {
        section.classList.add("stale");
        section.title = "not updated: " + error.message;
      });
  }
  document.querySelectorAll("[data-live]").forEach(function (section) {
    if (section.dataset.now) { refresh(section); }
    var every = parseFloat(section.dataset.every || "0");
    if (every > 0) { setInterval(function () { refresh(section); }, every * 1000); }
  });
})();
