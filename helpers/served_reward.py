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
  - Before the first answer (the start-up check, on three gray images): one try. A server that does not answer, or
    answers what is not scores, stops the run before anything is written (exit 2).
  - After it: a try that gets no answer (refused, dropped, reset, nothing received for --reward-timeout s) or a
    502 / 503 / 504 (a proxy or a server still loading) is tried again, after 1, 2, 4, 8, 16 and 32 s (RETRY_WAITS:
    a restarted server has about a minute to come back). Anything else (another status, an answer that is not G
    finite numbers), or a seventh try that fails, is a ServedRewardError: the run stops with one line, its landed
    steps saved and the command to continue (helpers/run.py's reward_failed). No group is ever trained on a score it
    did not get.
"""
import base64
import http.client
import io
import json
import math
import time
import urllib.error
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

class ServedReward:
    """The reward served at `url`, as a reward function: fn(images, example) -> (G,) float32 scores. `timeout`: the
    seconds a try waits for an answer (--reward-timeout). The module docstring gives the rules of its faults."""

    def __init__(self, url: str, timeout: float = 600.0):
        self.url, self.timeout = url, timeout
        self.answered = False  # until its first answer, a fault stops at once: a server that never answered is absent

    def __call__(self, images: torch.Tensor, example: dict) -> torch.Tensor:
        body = self.post(request_body(images, example))
        scores = read_answer(body, len(images))
        self.answered = True
        return torch.tensor(scores, dtype=torch.float32)

    def post(self, body: bytes) -> bytes:
        waits = RETRY_WAITS if self.answered else ()
        request = urllib.request.Request(self.url, body, {"Content-Type": "application/json"}, method="POST")
        for tries, wait in enumerate((0, *waits), start=1):
            time.sleep(wait)
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    if response.status != 200:  # urllib raises for >= 400; a 2xx other than 200 is no answer either
                        raise ServedRewardError(f"answered HTTP {response.status} {response.reason}; answer 200 with "
                                                "the scores")
                    return response.read()
            except urllib.error.HTTPError as error:  # it answered, with an error status
                problem = f"answered HTTP {error.code} {error.reason}{said(error)}"
                if error.code not in RETRIED_STATUSES:
                    raise ServedRewardError(problem) from None
            except NO_ANSWER as error:
                problem = f"did not answer ({reason(error, self.timeout)})"
        if not self.answered:
            raise ServedRewardError(f"{problem}; start its server (docs/rewards.md: python tools/reward_server.py) "
                                    "or fix the URL")
        raise ServedRewardError(f"{problem}, {tries} tries over {round(sum(waits), 3):g} s; is its server running?")


def said(error: urllib.error.HTTPError) -> str:
    """What an error answer's body says: its {"error": ...} or its first line."""
    try:
        text = error.read().decode(errors="replace").strip()
        text = json.loads(text).get("error", text) if text.startswith("{") else text
    except (OSError, ValueError, AttributeError):
        return ""
    return f": {str(text).splitlines()[0][:200]}" if text else ""


def reason(error: Exception, timeout: float) -> str:
    error = getattr(error, "reason", error)  # URLError wraps the socket's error
    if isinstance(error, TimeoutError) or "timed out" in str(error):
        return f"no answer within --reward-timeout {timeout:g} s"
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
