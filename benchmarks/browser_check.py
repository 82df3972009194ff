"""The quick-start notebook in a real browser (not part of the test suite).

Serves JupyterLab on localhost, opens examples/quickstart.ipynb (a copy) in headless Chromium,
runs all cells from the Run menu, checks the streaming view's DOM (three panels, tokens
coloured by origin, acceptance bars, the rich displays) and writes a screenshot of the view.
Two cells appended to the copy then start a long generation and click its Stop button with
the mouse while the cell runs: the requests must end "abort" and the pools be free again.

Needs Debian's chromium and chromium-driver, and jupyterlab + selenium (+ ipywidgets, for the
widget frontend) in the Python that runs this script:

    apt-get install chromium chromium-driver
    pip install jupyterlab selenium ipywidgets
    python benchmarks/browser_check.py --screenshot docs/notebook.png

The kernel runs --kernel-python (default: this Python) with this checkout on PYTHONPATH, so
JupyterLab may live in a separate virtual environment from mtpkit's:

    /tmp/jlab-venv/bin/python benchmarks/browser_check.py --kernel-python .venv/bin/python
"""

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "mtpkit-browser-check"


# Long enough (3 x 1900 tokens) that the click lands while the cell runs.
STOP_CELL = ("free = (llm.kv_pools.num_free, llm.slots.num_free)\n"
             "long = watch(llm, prompts, SamplingParams(max_tokens=1900, ignore_eos=True))")
STOP_REPORT = ("print('STOPCHECK', json.dumps({'reasons': [o.finish_reason for o in long], "
               "'lengths': [len(o.token_ids) for o in long], "
               "'pools_free': (llm.kv_pools.num_free, llm.slots.num_free) == free, "
               "'via_subshell': mtpkit.notebook.stop_channel._subshell_id is not None}))")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kernelspec(where: Path, python: str) -> None:
    """A kernel named mtpkit that imports this checkout."""
    d = where / "kernels" / "mtpkit"
    d.mkdir(parents=True)
    (d / "kernel.json").write_text(json.dumps({
        "argv": [python, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "mtpkit", "language": "python",
        "env": {"PYTHONPATH": str(ROOT)}}))


def wait_http(url: str, seconds: float) -> None:
    end = time.time() + seconds
    while time.time() < end:
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"JupyterLab did not answer at {url} within {seconds:.0f} s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernel-python", default=sys.executable, help="python with mtpkit's dependencies")
    ap.add_argument("--chromium", default="/usr/bin/chromium")
    ap.add_argument("--chromedriver", default="/usr/bin/chromedriver")
    ap.add_argument("--screenshot", default="docs/notebook.png")
    ap.add_argument("--timeout", type=float, default=300, help="seconds for all cells to run")
    args = ap.parse_args()

    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By

    work = Path(tempfile.mkdtemp(prefix="mtpkit-browser-"))
    kernelspec(work / "jupyter", args.kernel_python)
    nb = json.loads((ROOT / "examples" / "quickstart.ipynb").read_text())
    nb["metadata"]["kernelspec"] = {"name": "mtpkit", "display_name": "mtpkit", "language": "python"}
    nb["cells"] += [{"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None, "source": src}
                    for src in (STOP_CELL, STOP_REPORT)]
    (work / "quickstart.ipynb").write_text(json.dumps(nb))
    port = free_port()
    env = dict(os.environ, JUPYTER_PATH=str(work / "jupyter"), JUPYTER_CONFIG_DIR=str(work / "config"))
    jupyter = [sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
               f"--IdentityProvider.token={TOKEN}", f"--ServerApp.root_dir={work}", "--allow-root"]
    server = subprocess.Popen(jupyter, env=env, stdout=subprocess.DEVNULL, stderr=open(work / "server.log", "w"))
    driver = None
    try:
        wait_http(f"http://127.0.0.1:{port}/api/status?token={TOKEN}", 60)
        opts = webdriver.ChromeOptions()
        opts.binary_location = args.chromium
        for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1300,1800"):
            opts.add_argument(a)
        driver = webdriver.Chrome(service=Service(args.chromedriver), options=opts)
        driver.get(f"http://127.0.0.1:{port}/lab/tree/quickstart.ipynb?token={TOKEN}")

        def wait_for(js: str, seconds: float, what: str):
            end = time.time() + seconds
            while time.time() < end:
                value = driver.execute_script(js)
                if value:
                    return value
                time.sleep(0.5)
            driver.save_screenshot(str(work.parent / "mtpkit-browser-timeout.png"))
            text = driver.execute_script("return document.body.innerText")
            raise TimeoutError(f"timed out after {seconds:.0f} s waiting for {what} (page: "
                               f"{work.parent / 'mtpkit-browser-timeout.png'}); its text ends:\n{text[-1500:]}")

        wait_for("return document.querySelector('.jp-Notebook .jp-Cell') !== null", 90, "the notebook to open")
        # JupyterLab may ask which kernel to start (the notebook names it already): accept.
        time.sleep(3)
        driver.execute_script("const b = document.querySelector('.jp-Dialog .jp-mod-accept'); if (b) b.click();")
        wait_for("return document.querySelector('.jp-Notebook-ExecutionIndicator[data-status=\"idle\"]')"
                 " !== null || document.body.innerText.includes('Idle')", 90, "the kernel to start")
        driver.find_element(By.XPATH, "//div[contains(@class,'lm-MenuBar-itemLabel') and text()='Run']").click()
        driver.find_element(By.XPATH, "//div[contains(@class,'lm-Menu-itemLabel') and "
                                      "text()='Run All Cells']").click()
        t0 = time.time()
        # The long generation's view: click Stop (a real click) once it has tokens.
        wait_for("const v = document.querySelectorAll('.mtp-view'); return v.length == 2 && "
                 "v[1].querySelectorAll('.mtp-tok').length > 50", args.timeout, "the long generation")
        stop_button = driver.find_elements(By.CSS_SELECTOR, ".mtp-view")[1].find_element(By.TAG_NAME, "button")
        driver.execute_script("arguments[0].scrollIntoView()", stop_button)
        stop_button.click()
        wait_for("return document.body.textContent.includes('STOPCHECK {') || "
                 "document.querySelector('.jp-OutputArea-output[data-mime-type=\"application/vnd.jupyter.stderr\"]')"
                 " !== null && document.body.innerText.includes('Traceback')", args.timeout, "the last cell")
        report = json.loads(driver.execute_script(
            "return document.body.textContent").split("STOPCHECK ", 1)[1].split("}", 1)[0] + "}")
        print(f"after the click on Stop: {report}")
        errors = driver.execute_script("return [...document.querySelectorAll('.jp-OutputArea-output')]"
                                       ".map(e => e.innerText).filter(t => t.includes('Traceback'))")
        if errors:
            print("a cell raised:\n" + errors[0][:2000])
            return 1
        dom = driver.execute_script("""
            const view = document.querySelector('.mtp-view');
            const toks = [...view.querySelectorAll('.mtp-tok')];
            // textContent: JupyterLab does not lay out cells outside the viewport (no innerText)
            return {
              panels: view.querySelectorAll('.mtp-panel').length,
              tokens: toks.length,
              drafts: toks.filter(t => t.dataset.draft !== '0').length,
              colours: [...new Set(toks.map(t => getComputedStyle(t).backgroundColor))].length,
              titles: toks.filter(t => /^step \\d+ · /.test(t.title)).length,
              bars: [...view.querySelectorAll('.mtp-bar')].map(b => b.getBoundingClientRect().width),
              rate: view.querySelector('.mtp-rate') ? view.querySelector('.mtp-rate').textContent : '',
              stop: [...view.querySelectorAll('button')].some(b => b.textContent.includes('Stop')),
              rich: ['.mtp-output', '.mtp-stats', '.mtp-trace', '.mtp-trace-viewer', '.mtp-shape-error']
                      .filter(s => document.querySelector(s) === null),
            };""")
        print(f"all cells ran in {time.time() - t0:.1f} s; view: {json.dumps(dom)}")
        problems = []
        if dom["panels"] != 3:
            problems.append(f"{dom['panels']} panels, expected 3")
        if not dom["tokens"] or not dom["drafts"] or dom["colours"] < 3:
            problems.append("tokens missing, none from accepted drafts, or fewer than 3 colours")
        if dom["titles"] != dom["tokens"]:
            problems.append("a token without its step / origin on hover")
        if len(dom["bars"]) != 3 or not all(w > 0 for w in dom["bars"]):
            problems.append(f"acceptance bars {dom['bars']}, expected 3 of non-zero width")
        if "tok/s" not in dom["rate"] or not dom["stop"]:
            problems.append("tokens/s or the Stop button missing")
        if set(report["reasons"]) != {"abort"} or not all(n < 1900 for n in report["lengths"]) or \
                not report["pools_free"]:
            problems.append("Stop did not abort the running requests and free their storage")
        if dom["rich"]:
            problems.append(f"rich displays missing: {dom['rich']}")
        view = driver.find_element(By.CSS_SELECTOR, ".mtp-view")
        driver.execute_script("arguments[0].scrollIntoView()", view)
        out = ROOT / args.screenshot
        out.parent.mkdir(parents=True, exist_ok=True)
        view.screenshot(str(out))
        print(f"screenshot: {out} ({out.stat().st_size // 1024} KiB)")
        for p in problems:
            print("FAIL:", p)
        print("browser check", "FAILED" if problems else "passed")
        return 1 if problems else 0
    finally:
        if driver is not None:
            driver.quit()
        server.terminate()
        server.wait(timeout=30)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
