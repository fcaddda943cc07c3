"""A reward in its own process: `--reward http://HOST:PORT/NAME`, the protocol it speaks, and its faults' rules.

A served reward runs in a server of its own (tools/reward_server.py, or any HTTP server that speaks the protocol
below): on another GPU or machine, with its own packages (a preference model that pins an older transformers than
GLM-Image needs). The run sends it one request per group and reads back the group's scores; under torchrun every
process sends its own groups'.

The protocol (docs/rewards.md has it with a server in a page of code):
  request   POST to the URL, Content-Type application/json, body
              {"images": [G images], "example": {the example's fields: "prompt", "target", "source", any field of
               its .jsonl line, "where" its file:line}}
            every image (the G samples; "target" and "source" when the example has them) a data URL of an 8-bit RGB
            PNG, "data:image/png;base64,...", as the DiT decoded it rounded to 8 bits (what a viewer, and every
            preference model's processor, reads); every other field as JSON has it (a field that is not JSON: its
            str). A None field is null. The images are the run's H x W; the body has a Content-Length.
  answer    status 200, Content-Type application/json, body {"scores": [G finite numbers]} (not booleans), higher is
            better, in the order of the images; any other status: an error, whose body may say why ({"error": ...}).
  A request may come twice (a retry after a timeout, while the first is still scored): a server must not count
  requests. Under torchrun every process sends its own, at once: a server that answers one at a time makes the last
  wait for the others, and --reward-timeout must cover that wait.

The faults and their rules (docs/robustness.md):
  - A try is one POST answered in full within --reward-timeout seconds, from connecting to the answer's last byte: a
    deadline (a server that trickles its answer a byte a second cannot stretch it).
  - Before the first answer (the start-up check, on three gray images): one try, or, with --reward-wait S, a try every
    2 s for up to S seconds while its server starts (refused, or 502 / 503 / 504). A server that does not answer, or
    answers what is not scores, stops the run before anything is written (exit 2).
  - After it: a try that gets no answer (refused, dropped, reset, no whole answer in time) or a 502 / 503 / 504 (a
    proxy or a server still loading) is tried again, after 1, 2, 4, 8, 16 and 32 s (RETRY_WAITS: a restarted server
    has about a minute to come back), each said in one line. Anything else (another status, a redirect, an answer
    that is not G finite numbers), or a seventh try that fails, is a ServedRewardError: the run stops with one line,
    its landed steps saved and the command to continue (helpers/run.py's reward_failed). No group is ever trained on
    a score it did not get.
  - A redirect (3xx) is an error naming where it points, never followed: urllib would follow a POST's 302 as a GET
    without the images, and a target answering a GET with G numbers would be trained on.
  - Proxies: a loopback URL (localhost, 127.0.0.0/8, ::1) never goes through one; any other follows the environment
    (http_proxy, https_proxy, no_proxy), and every message about it names the proxy it went through.
"""
import base64
import contextlib
import html.parser
import http.client
import io
import ipaddress
import json
import math
import socket
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

import numpy as np
import torch
from PIL import Image

PNG = "data:image/png;base64,"  # how every image travels: a data URL of an 8-bit RGB PNG
RETRY_WAITS = (1, 2, 4, 8, 16, 32)  # seconds before each try again: 63 s in all
RETRIED_STATUSES = (502, 503, 504)  # a proxy without its server, a server still loading: a later try may succeed
NO_ANSWER = (OSError, http.client.HTTPException)  # refused, dropped, reset, timed out (URLError is an OSError)


class ServedRewardError(Exception):
    """A served reward that did not answer, or answered what is not one finite score per image."""


def is_url(name: str) -> bool:
    """Whether a --reward entry names a served reward (http:// or https://)."""
    return name.startswith(("http://", "https://"))


# ---- The protocol: images as data URLs, the example as JSON ---------------------------------------------------------

def encode_image(image: torch.Tensor) -> str:
    """(3, H, W) (or (1, H, W)) float in [0, 1] -> a data URL of an 8-bit RGB PNG (each value rounded to k / 255)."""
    array = (image.detach().float().clamp(0, 1).expand(3, -1, -1).permute(1, 2, 0).cpu().numpy() * 255).round()
    buffer = io.BytesIO()
    Image.fromarray(array.astype(np.uint8)).save(buffer, format="PNG")
    return PNG + base64.b64encode(buffer.getvalue()).decode("ascii")


def decode_image(text: str) -> torch.Tensor:
    """A data URL of a PNG (or any image Pillow reads) -> (3, H, W) float32 in [0, 1]. Raises ValueError."""
    if not text.startswith("data:image/") or ";base64," not in text:
        raise ValueError(f"not an image data URL: {text[:40]!r}")
    data = base64.b64decode(text.split(";base64,", 1)[1], validate=True)
    array = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"), dtype=np.uint8)
    return torch.from_numpy(array.copy()).permute(2, 0, 1).float() / 255


def is_image(value) -> bool:
    return torch.is_tensor(value) and value.dim() == 3 and value.shape[0] in (1, 3)


def field_json(value):
    """An example's field as the request carries it: an image tensor as a data URL, JSON's own types as they are,
    anything else as its str."""
    if is_image(value):
        return encode_image(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [field_json(v) for v in value]
    if isinstance(value, dict):
        return {str(k): field_json(v) for k, v in value.items()}
    return str(value)


def request_body(images: torch.Tensor, example: dict) -> bytes:
    """(G, 3, H, W) images in [0, 1] and the example -> the request's JSON body (utf-8)."""
    return json.dumps({"images": [encode_image(image) for image in images],
                       "example": {str(k): field_json(v) for k, v in example.items()}}).encode()


def read_request(body: bytes) -> tuple[torch.Tensor, dict]:
    """A request's body -> (G, 3, H, W) float32 images in [0, 1] and the example, its image fields (strings that are
    image data URLs) as (3, H, W) tensors: what a reward function takes. Raises ValueError naming what is wrong."""
    request = json.loads(body)
    if not isinstance(request, dict) or not isinstance(request.get("images"), list) or not request["images"]:
        raise ValueError('the body is not {"images": [data URLs], "example": {...}}')
    example = request.get("example") or {}
    example = {k: decode_image(v) if isinstance(v, str) and v.startswith("data:image/") else v
               for k, v in example.items()}
    return torch.stack([decode_image(image) for image in request["images"]]), example


def read_answer(body: bytes, n: int) -> list[float]:
    """An answer's body -> its n scores. Raises ServedRewardError when it is not {"scores": [n finite numbers]}."""
    try:
        answer = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise ServedRewardError(f'answered what is not JSON ({body[:60]!r}); answer {{"scores": [{n} numbers]}}') \
            from None
    values = answer.get("scores") if isinstance(answer, dict) else None
    if not isinstance(values, list) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                               for v in values):
        raise ServedRewardError(f'answered {json.dumps(answer)[:80]}, not {{"scores": [{n} numbers]}}')
    if len(values) != n:
        raise ServedRewardError(f"answered {len(values)} scores for {n} images; answer one score per image")
    if not all(math.isfinite(v) for v in values):
        raise ServedRewardError(f"answered non-finite scores {values}; answer finite numbers")
    return [float(v) for v in values]


# ---- The client: one request a group, tried again when the server did not answer -----------------------------------

# ---- The network as clusters set it: proxies, redirects, deadlines ----------------------------------------------

def loopback(host: str | None) -> bool:
    """Whether `host` is this machine itself: localhost, 127.0.0.0/8 or ::1."""
    if not host:
        return False
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def proxy_for(url: str) -> str | None:
    """The proxy a request to `url` goes through, or None. The rule: a loopback host never goes through one (a proxy
    elsewhere cannot reach this machine's own servers; clusters set http_proxy for the outside world), nor a host that
    no_proxy names; any other takes the environment's http_proxy / https_proxy (as urllib, curl and requests read
    them)."""
    parts = urllib.parse.urlsplit(url)
    if loopback(parts.hostname) or urllib.request.proxy_bypass_environment(parts.hostname or ""):
        return None
    return urllib.request.getproxies_environment().get(parts.scheme)


class NoRedirects(urllib.request.HTTPRedirectHandler):
    """A redirect is an answer that is not the scores (a POST followed as a GET would lose its body): urllib raises it
    as an HTTPError with its 3xx status."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


class ServedReward:
    """The reward served at `url`, as a reward function: fn(images, example) -> (G,) float32 scores. `timeout`: the
    seconds a try may take, the whole request from connecting to the last byte of the answer (--reward-timeout: a
    deadline, not a wait between two bytes); `wait`: the seconds its first answer may take to come, trying every 2 s
    while its server starts (--reward-wait); `address`: where it is served now, when it moved since the run started
    (the url stays its name, the metrics' reward/<url>). The module docstring gives the rules of its faults. Every
    try again is one line on stderr."""

    def __init__(self, url: str, timeout: float = 600.0, wait: float = 0.0, address: str | None = None):
        self.url, self.timeout, self.wait, self.address = url, timeout, wait, address or url
        self.proxy = proxy_for(self.address)
        self.answered = False  # until its first answer, a fault stops at once: a server that never answered is absent

    def __call__(self, images: torch.Tensor, example: dict) -> torch.Tensor:
        body = self.post(request_body(images, example))
        scores = read_answer(body, len(images))
        self.answered = True
        return torch.tensor(scores, dtype=torch.float32)

    def where(self) -> str:
        """How the messages name where it was asked: its address when it moved, and the proxy when one was used."""
        moved = f" at {self.address}" if self.address != self.url else ""
        return f"{moved} via proxy {self.proxy}" if self.proxy else moved

    def post(self, body: bytes) -> bytes:
        began = time.monotonic()
        waits = RETRY_WAITS if self.answered else ()
        tries, problem = 0, ""
        while True:
            tries += 1
            try:
                return self.try_once(body)
            except urllib.error.HTTPError as error:  # it answered, with an error status
                problem = answered(error, self.address)
                if error.code not in RETRIED_STATUSES:
                    raise ServedRewardError(problem + self.where()) from None
            except NO_ANSWER as error:
                problem = f"did not answer ({reason(error, self.timeout)})"
            starting = not self.answered and time.monotonic() - began + 2 <= self.wait  # its server may be loading
            if tries > len(waits) and not starting:
                break
            pause = 2 if starting else waits[tries - 1]
            total = "" if starting else f" of {len(waits) + 1}"
            print(f"served reward {self.url}{self.where()}: {problem}; trying again in {pause} s (try {tries + 1}"
                  f"{total})", file=sys.stderr, flush=True)
            time.sleep(pause)
        spent = time.monotonic() - began
        if not self.answered:
            waited = f" (waited {spent:.0f} s: --reward-wait)" if self.wait else ""
            raise ServedRewardError(f"{problem}{self.where()}{waited}; start its server (docs/rewards.md: python "
                                    "tools/reward_server.py; --reward-wait S waits for one that starts) or fix the "
                                    "URL")
        raise ServedRewardError(f"{problem}{self.where()}, {tries} tries over {spent:.1f} s; is its server running?")

    def try_once(self, body: bytes) -> bytes:
        """One POST, answered in full within `timeout` seconds: its body, or the error (HTTPError for a status that is
        not 200, TimeoutError past the deadline). The request runs in a thread the deadline abandons: a server that
        sends one byte a second keeps no try alive longer (urllib's timeout bounds each wait between two bytes
        only)."""
        handlers = [urllib.request.ProxyHandler({urllib.parse.urlsplit(self.address).scheme: self.proxy}
                                                if self.proxy else {}), NoRedirects()]
        opener = urllib.request.build_opener(*handlers)
        request = urllib.request.Request(self.address, body, {"Content-Type": "application/json"}, method="POST")
        outcome, connection = {}, {}

        def ask():
            try:
                with opener.open(request, timeout=self.timeout) as response:
                    connection["response"] = response
                    if response.status != 200:  # urllib raises for >= 400; another 2xx is no answer either
                        outcome["error"] = ServedRewardError(f"answered HTTP {response.status} {response.reason}; "
                                                             "answer 200 with the scores")
                        return
                    outcome["body"] = response.read()
            except BaseException as error:  # noqa: BLE001 (handed to the caller)
                outcome["error"] = error

        worker = threading.Thread(target=ask, daemon=True)
        worker.start()
        worker.join(self.timeout)
        if worker.is_alive():  # past the deadline: the answer, if it ever comes, is dropped with the connection
            # (shut down under the reading thread: closing the response would wait for its read to end)
            sock = getattr(getattr(getattr(connection.get("response"), "fp", None), "raw", None), "_sock", None)
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            raise TimeoutError(f"no whole answer within --reward-timeout {self.timeout:g} s")
        if "error" in outcome:
            raise outcome["error"]
        return outcome["body"]


def answered(error: urllib.error.HTTPError, url: str) -> str:
    """An error status in words: a redirect names where it points (its Location) and the fix."""
    if 300 <= error.code < 400:
        target = error.headers.get("Location", "") if error.headers else ""
        to = f" to {urllib.parse.urljoin(url, target)}" if target else ""
        return (f"answered HTTP {error.code} {error.reason}, a redirect{to}; give --reward the URL that answers the "
                "POST itself (a redirect is not followed: a POST followed as a GET loses its images)")
    return f"answered HTTP {error.code} {error.reason}{said(error)}"


class PageText(html.parser.HTMLParser):
    """The words of an HTML page: its <title>, and its text outside <script> and <style>."""

    def __init__(self):
        super().__init__()
        self.title, self.text, self.inside = "", [], []

    def handle_starttag(self, tag, attrs):
        self.inside.append(tag)

    def handle_endtag(self, tag):
        if tag in self.inside:
            del self.inside[len(self.inside) - 1 - self.inside[::-1].index(tag):]

    def handle_data(self, data):
        if "title" in self.inside:
            self.title += data
        elif not {"script", "style", "head"} & set(self.inside) and data.strip():
            self.text.append(" ".join(data.split()))


def said(error: urllib.error.HTTPError) -> str:
    """What an error answer's body says: its {"error": ...}, an HTML page's title and first words (a framework's
    error page), or its first line."""
    try:
        text = error.read().decode(errors="replace").strip()
        if text.startswith("{"):
            text = json.loads(text).get("error", text)
        elif text[:1] == "<":
            page = PageText()
            page.feed(text)
            title, words = " ".join(page.title.split()), [t for t in page.text if t != page.title.strip()]
            text = "; ".join(part for part in (title, " ".join(words)[:160]) if part) or text
    except (OSError, ValueError, AttributeError):
        return ""
    return f": {str(text).splitlines()[0][:200]}" if text else ""


def reason(error: Exception, timeout: float) -> str:
    error = getattr(error, "reason", error)  # URLError wraps the socket's error
    if isinstance(error, TimeoutError) or "timed out" in str(error):
        return f"no whole answer within --reward-timeout {timeout:g} s"
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
