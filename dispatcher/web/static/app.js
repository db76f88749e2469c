// Refresh the page's <main> every few seconds (one request each time), unless the person is
// typing in it, has typed in one of its fields without sending it, or the tab is hidden. No library: nothing is loaded from outside the package.
(function () {
  "use strict";
  var main = document.getElementById("main");
  if (!main) { return; }
  var every = parseInt(main.getAttribute("data-poll"), 10) || 3000;
  var busy = false;
  function typing() {
    var el = document.activeElement;
    if (el && main.contains(el) && (el.tagName === "INPUT" || el.tagName === "TEXTAREA" || el.tagName === "SELECT")) {
      return true;
    }
    // a note or reason typed and not sent yet, its field left: a refresh would wipe it
    var fields = main.querySelectorAll("input[type=text], input:not([type]), textarea");
    for (var i = 0; i < fields.length; i++) {
      if (fields[i].value !== fields[i].defaultValue) { return true; }
    }
    return false;
  }
  function refresh() {
    if (busy || document.hidden || typing()) { return; }
    busy = true;
    var url = new URL(window.location.href);
    url.searchParams.set("partial", "1");
    url.searchParams.delete("msg");
    fetch(url.toString(), {credentials: "same-origin", cache: "no-store"})
      .then(function (r) { return r.ok ? r.text() : null; })
      .then(function (html) {
        if (html !== null && !typing()) {
          var msg = document.getElementById("message");
          main.innerHTML = html;
          if (msg && !document.getElementById("message")) {
            var h1 = main.querySelector("h1");
            if (h1) { h1.insertAdjacentElement("afterend", msg); }
          }
          main.setAttribute("data-refreshed", String(Date.now()));
        }
      })
      .catch(function () { /* the server is restarting: try again at the next turn */ })
      .then(function () { busy = false; });
  }
  window.setInterval(refresh, every);
})();
