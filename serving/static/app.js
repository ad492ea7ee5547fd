// The demo page: two tabs over the server's own routes (docs/demo.md).
import { getJson, rememberKey } from "./api.js";
import { jobsState, setupJobs } from "./jobs.js";
import { setupTalk, talkState } from "./talk.js";

// The page's state, read by people in the console and by tests/browser.
window.demo = { talk: talkState, jobs: jobsState, ready: false, error: null };

function selectTab(name) {
  for (const tab of document.querySelectorAll("[role=tab]")) {
    const selected = tab.id === `tab-${name}`;
    tab.setAttribute("aria-selected", String(selected));
    document.getElementById(tab.getAttribute("aria-controls")).hidden = !selected;
  }
  history.replaceState(null, "", `#${name}`);
}

async function main() {
  rememberKey();
  // a new key may open other pipelines: list them again with it
  document.getElementById("api-key").addEventListener("change", () => location.reload());
  for (const tab of document.querySelectorAll("[role=tab]")) {
    tab.addEventListener("click", () => selectTab(tab.id.slice(4)));
  }
  selectTab(location.hash === "#jobs" ? "jobs" : "talk");
  const models = await getJson("/v1/models");
  await setupTalk(models.data);
  await setupJobs();
  window.demo.ready = true;
}

main().catch((error) => {
  window.demo.error = String(error.message || error);
  document.body.prepend(Object.assign(document.createElement("p"), { className: "status", textContent: window.demo.error }));
});
