"""A reward in its own process (helpers/served_reward.py, tools/reward_server.py): the protocol, a real server on
127.0.0.1 in a process of its own, a whole run of `main` scored by it, and each fault's rule (docs/robustness.md).
Nothing but loopback; every wait bounded."""
import json
import math
import os
import re
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

import grpo
from helpers import served_reward, trainer
from helpers.served_reward import ServedReward, ServedRewardError
from helpers.user_input import RewardError, parse_rewards
from tests.conftest import ROOT, TINY, expect_exit, run_record, write_example

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def eight_bits(images: torch.Tensor) -> torch.Tensor:
    """What the server sees of float pictures: each value rounded to k / 255."""
    return (images.clamp(0, 1) * 255).round() / 255


def start(*command: str, first_line: str = "serving") -> tuple[subprocess.Popen, int]:
    """A server started in its own process -> (process, port): the port read from its first line."""
    process = subprocess.Popen([sys.executable, *command], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               cwd=ROOT, env=ENV)
    line = [None]
    reader = threading.Thread(target=lambda: line.__setitem__(0, process.stdout.readline()), daemon=True)
    reader.start()
    reader.join(120)
    if not line[0] or first_line not in line[0]:
        process.kill()
        raise AssertionError(f"the server did not start: {line[0]!r} {process.stderr.read()[-2000:]}")
    return process, int(re.search(r"(?:127\.0\.0\.1:)?(\d+)", line[0].split("serving", 1)[1]).group(1))


def stop(process: subprocess.Popen) -> None:
    process.kill()
    process.wait(10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def faulty(script: str = "", port: int = 0) -> tuple[subprocess.Popen, int]:
    """tests/fault_server.py: `brightness` at any path, its n-th request answered as the script's n-th cue."""
    return start(str(ROOT / "tests" / "fault_server.py"), str(port), *([script] if script else []))


@pytest.fixture(scope="module")
def project_server():
    """tools/reward_server.py serving two of the project's rewards, on the CPU; stopped by SIGTERM at the end."""
    process, port = start(str(ROOT / "tools" / "reward_server.py"), "ssim", "shapes", "--port", "0", "--device", "cpu")
    yield f"http://127.0.0.1:{port}"
    process.terminate()  # SIGTERM: it stops cleanly
    out, _ = process.communicate(timeout=30)
    assert process.returncode == 0 and "reward_server.py: stopped" in out


def test_protocol():
    """A request carries the pictures as 8-bit PNG data URLs and every field of the example (its images as PNGs too,
    None as null, anything else as its str); the server's reading of it gives back the pictures rounded to 8 bits,
    exactly, and the fields. An answer is taken only as G finite numbers."""
    images = torch.rand(3, 3, 40, 56)
    example = {"prompt": "a red circle", "target": torch.rand(3, 40, 56), "source": None, "where": "p.jsonl:3",
               "category": "single", "count": 2, "tags": ["a", 1.5]}
    body = json.loads(served_reward.request_body(images, example))
    assert all(url.startswith("data:image/png;base64,") for url in body["images"]) and len(body["images"]) == 3
    assert body["example"]["source"] is None and body["example"]["tags"] == ["a", 1.5]
    read, fields = served_reward.read_request(json.dumps(body).encode())
    assert torch.equal(read, eight_bits(images))
    assert torch.equal(fields["target"], eight_bits(example["target"]))
    assert {k: v for k, v in fields.items() if k != "target"} == {k: v for k, v in example.items() if k != "target"}
    assert served_reward.read_answer(b'{"scores": [1, 0.5, -2]}', 3) == [1.0, 0.5, -2.0]
    for answer, needle in [(b"<html>", "not JSON"), (b'{"score": 1}', "not {\"scores\""), (b'[1, 2, 3]', "not"),
                           (b'{"scores": [1, 2]}', "2 scores for 3 images"),
                           (b'{"scores": [1, NaN, 2]}', "non-finite"), (b'{"scores": [1, "2", 3]}', "not"),
                           (b'{"scores": [true, false, true]}', "not")]:
        with pytest.raises(ServedRewardError, match=re.escape(needle)):
            served_reward.read_answer(answer, 3)
    with pytest.raises(ValueError, match="not an image data URL"):
        served_reward.decode_image("https://example.com/a.png")


def test_parse_served_reward():
    """A URL in --reward is a served reward named by its URL, weighed like any other (its ':' and '@' are the URL's)."""
    rewards = parse_rewards("http://user@127.0.0.1:9/ssim=0.5,ssim", trainer.reward_table(grpo), timeout=7)
    fn, weight = rewards["http://user@127.0.0.1:9/ssim"]
    assert weight == 0.5 and isinstance(fn.__wrapped__, ServedReward) and fn.__wrapped__.timeout == 7


def test_server_scores_as_in_process(project_server):
    """tools/reward_server.py's scores for a group equal the same reward's in the run's process on the 8-bit
    pictures, bit for bit; an unknown path is a 404 whose message names what the server has."""
    gen = torch.Generator().manual_seed(0)
    images, target = torch.rand(4, 3, 64, 64, generator=gen), torch.rand(3, 64, 64, generator=gen)
    example = {"prompt": "a red circle", "target": target, "source": None, "where": "p.txt:1"}
    rewards = parse_rewards(f"{project_server}/ssim,{project_server}/shapes", trainer.reward_table(grpo))
    for name in ("ssim", "shapes"):
        served = rewards[f"{project_server}/{name}"][0](images, example)
        local = trainer.reward_table(grpo)[name](eight_bits(images), {**example, "target": eight_bits(target)})
        assert torch.equal(served, local.float()), name
    with pytest.raises(RewardError, match="HTTP 404 .*no reward at /pickscore; this server has /ssim, /shapes"):
        parse_rewards(f"{project_server}/pickscore", trainer.reward_table(grpo))[f"{project_server}/pickscore"][0](images, example)


def test_main_with_served_reward(tmp_path, project_server, monkeypatch):
    """A whole run of `main` scored by a served reward equals the run scored in-process by the same function on the
    8-bit pictures: every metric of every step, bit for bit (the reward's own key aside, named by its URL)."""
    def ssim_8bit(images, example):
        return grpo.ssim_reward(eight_bits(images), {**example, "target": eight_bits(example["target"])})

    monkeypatch.setitem(grpo.REWARDS, "ssim_8bit", ssim_8bit)
    prompts = write_example(tmp_path, ["a gray square | t.png", "another | t.png"])
    common = [*TINY, "--prompts", str(prompts), "--steps", "2", "--image-every", "0", "--temperature", "2.0"]
    grpo.main([*common, "--reward", f"{project_server}/ssim", "--out", str(tmp_path / "served")])
    grpo.main([*common, "--reward", "ssim_8bit", "--out", str(tmp_path / "local")])
    served, local = run_record(tmp_path / "served"), run_record(tmp_path / "local")
    assert len(served) == 2 and served[0][f"reward/{project_server}/ssim"] == local[0]["reward/ssim_8bit"]
    strip = lambda line: {k: v for k, v in line.items() if not k.startswith("reward/")}  # noqa: E731
    assert [strip(x) for x in served] == [strip(x) for x in local]
    assert served[-1]["reward_std"] > 0  # the group spread: the scores reached the loss


def test_start_up_faults(tmp_path, monkeypatch, capsys):
    """Before anything is written: a URL where nothing listens, a server answering 503 (tried once: a server that never
    answered is not waited for), a page that is not scores, a score short: one line each naming the URL and the
    fault, exit 2, no run directory."""
    monkeypatch.setattr(served_reward, "RETRY_WAITS", (0.05,) * 6)  # (were it to retry)
    prompts = write_example(tmp_path, ["a gray square | t.png"])
    out = tmp_path / "run"
    argv = [*TINY, "--prompts", str(prompts), "--steps", "1", "--out", str(out)]
    nowhere = f"http://127.0.0.1:{free_port()}/brightness"
    err = expect_exit([*argv, "--reward", nowhere], 2, f"reward '{nowhere}' did not answer (ConnectionRefusedError",
                      capsys)
    assert "start its server" in err and "tries" not in err  # one try: a server that never answered is absent
    process, port = faulty("503,text,short")
    try:
        url = f"http://127.0.0.1:{port}/brightness"
        expect_exit([*argv, "--reward", url], 2, "answered HTTP 503 Service Unavailable: cue 503", capsys)  # one try
        expect_exit([*argv, "--reward", url], 2, "answered what is not JSON (b'<html>not scores</html>')", capsys)
        expect_exit([*argv, "--reward", f"ssim=1,{url}=0"], 2, "answered 2 scores for 3 images", capsys)
    finally:
        stop(process)
    assert not out.exists()


def test_faults_retried(tmp_path, monkeypatch, capsys):
    """In the run, a slow answer (past --reward-timeout), a dropped connection and a 503 are tried again: the run
    trains on the answer that came, as the run that met no fault."""
    monkeypatch.setattr(served_reward, "RETRY_WAITS", (0.05,) * 6)
    process, port = faulty("ok,slow,drop,503")  # 1: the start-up check; step 1: slow, drop, 503, then ok
    try:
        url = f"http://127.0.0.1:{port}/brightness"
        prompts = write_example(tmp_path, ["a gray square | t.png", "another | t.png"])
        common = [*TINY, "--prompts", str(prompts), "--steps", "2", "--image-every", "0", "--reward", url,
                  "--reward-timeout", "1", "--temperature", "2.0"]
        begin = time.perf_counter()
        grpo.main([*common, "--out", str(tmp_path / "faults")])
        assert time.perf_counter() - begin < 60
        grpo.main([*common, "--out", str(tmp_path / "clean")])  # the script is spent: every answer comes at once
    finally:
        stop(process)
    assert run_record(tmp_path / "faults") == run_record(tmp_path / "clean")
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("cue, needle", [
    ("short", "answered 3 scores for 4 images"), ("nan", "answered non-finite scores [nan,"),
    ("500", "answered HTTP 500 Internal Server Error: cue 500"), ("exit", "did not answer (ConnectionRefusedError"),
])
def test_faults_stop_the_run(tmp_path, monkeypatch, capsys, cue, needle):
    """In the run, an answer that is not G finite numbers, an error status, or a server gone for good (7 tries): one
    line naming the URL, the fault and the example, the landed step saved, the command to continue, exit 1; no
    group trained on a score it did not get (step 2 never lands)."""
    monkeypatch.setattr(served_reward, "RETRY_WAITS", (0.05,) * 6)
    process, port = faulty(f"ok,ok,{cue}")  # the start-up check, step 1, then the fault at step 2
    url = f"http://127.0.0.1:{port}/brightness"
    prompts = write_example(tmp_path, ["a gray square | t.png", "another | t.png"])
    out = tmp_path / "run"
    try:
        err = expect_exit([*TINY, "--prompts", str(prompts), "--steps", "3", "--image-every", "0", "--reward", url,
                           "--out", str(out)], 1, f"reward '{url}' {needle}", capsys)
    finally:
        stop(process)
    assert f"on {prompts}:2" in err and f"--resume {out}" in err and "checkpoint at step 1" in err
    assert [x["step"] for x in run_record(out)] == [1] and (out / "checkpoints" / "step-1").is_dir()
    if cue == "exit":  # every try again said, and the tries' whole time (their waits and the tries themselves)
        assert all(f"trying again in 0.05 s (try {n} of 7)" in err for n in range(2, 8)), err
        assert float(re.search(r"7 tries over (\d+\.\d) s", err).group(1)) >= 0.3


def test_server_restarted():
    """A server stopped and started again on its port while the run waits: the retry reaches the new one, which
    scores as the first did. Gone for good: seven tries, then the fault."""
    process, port = faulty()
    reward = ServedReward(f"http://127.0.0.1:{port}/brightness", timeout=10)
    images = torch.rand(2, 3, 32, 32)
    first = reward(images, {"prompt": "x"})
    stop(process)
    later = []
    restart = threading.Timer(0.5, lambda: later.append(faulty(port=port)[0]))
    restart.start()
    try:
        assert torch.equal(reward(images, {"prompt": "x"}), first)  # refused, then answered after 1 s (and 2 s)
    finally:
        restart.join()
        for p in later:
            stop(p)
    served_reward.RETRY_WAITS, waits = (0.01,) * 6, served_reward.RETRY_WAITS
    try:
        with pytest.raises(ServedRewardError, match=r"did not answer \(ConnectionRefusedError.*7 tries over \d+\.\d s"):
            reward(images, {"prompt": "x"})
    finally:
        served_reward.RETRY_WAITS = waits


def test_server_from_the_docs(tmp_path):
    """The page of code in docs/rewards.md is a server the run can use as written: its scores are the 8-bit
    pictures' mean brightness; a path it does not serve is its 500, quoted."""
    text = (ROOT / "docs" / "rewards.md").read_text()
    code = re.search(r"```python\n(# my_reward_server\.py.*?)```", text, re.S).group(1)
    (tmp_path / "my_reward_server.py").write_text(code)
    port = free_port()
    process = subprocess.Popen([sys.executable, str(tmp_path / "my_reward_server.py"), str(port)], env=ENV,
                               stderr=subprocess.DEVNULL)
    try:
        for _ in range(200):  # until it listens (numpy and Pillow import in a second or two)
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)
        images = torch.rand(3, 3, 32, 48)
        served = ServedReward(f"http://127.0.0.1:{port}/brightness")(images, {"prompt": "x", "target": None})
        expected = [float(np.asarray(np.round(im.permute(1, 2, 0).numpy() * 255), dtype=np.float64).mean() / 255)
                    for im in images]
        assert torch.equal(served, torch.tensor(expected, dtype=torch.float32))
        with pytest.raises(ServedRewardError, match=r"HTTP 500 .*LookupError\('no reward at /other'\)"):
            ServedReward(f"http://127.0.0.1:{port}/other")(images, {"prompt": "x"})
    finally:
        stop(process)
    assert all(math.isfinite(v) for v in expected)


# ---- The network as clusters set it: proxies, deadlines, redirects, servers that start late or move ------------------

def test_proxy_rule(monkeypatch):
    """A loopback URL never goes through a proxy (a cluster's http_proxy reaches the outside world, not this machine's
    own servers); another follows http_proxy / https_proxy unless no_proxy names its host."""
    monkeypatch.setenv("http_proxy", "http://proxy.example:3128")
    monkeypatch.setenv("https_proxy", "http://proxy.example:3129")
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    for url in ("http://127.0.0.1:8000/r", "http://localhost:8000/r", "http://[::1]:8000/r", "http://127.8.9.1/r"):
        assert served_reward.proxy_for(url) is None, url
    assert served_reward.proxy_for("http://judge.internal:8000/r") == "http://proxy.example:3128"
    assert served_reward.proxy_for("https://judge.internal/r") == "http://proxy.example:3129"
    monkeypatch.setenv("no_proxy", "judge.internal,other")
    assert served_reward.proxy_for("http://judge.internal:8000/r") is None


def test_loopback_under_a_proxy(monkeypatch):
    """With http_proxy set to a proxy that does not exist, a served reward on 127.0.0.1 answers (issue 85: exit 2, 'did
    not answer', while the server was up); a remote one goes through the proxy (here the fault server stands in for
    it), and a message about it says so."""
    process, port = faulty("ok,500")
    try:
        monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{free_port()}")  # nothing listens there
        images = torch.rand(2, 3, 16, 16)
        assert ServedReward(f"http://127.0.0.1:{port}/brightness", timeout=10)(images, {}).shape == (2,)
        monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{port}")  # the proxy: answers any path
        remote = ServedReward("http://judge.example/brightness", timeout=10)
        with pytest.raises(ServedRewardError, match=rf"HTTP 500 .* via proxy http://127.0.0.1:{port}"):
            remote(images, {})
    finally:
        stop(process)


def test_timeout_is_a_deadline():
    """--reward-timeout bounds a try from connecting to the answer's last byte: a server that sends its headers, then
    its answer a byte a second, is cut at the deadline (issue 85: 42.6 s for one step at --reward-timeout 3)."""
    process, port = faulty("trickle")
    try:
        reward = ServedReward(f"http://127.0.0.1:{port}/brightness", timeout=2)
        begin = time.perf_counter()
        with pytest.raises(ServedRewardError, match=r"no whole answer within --reward-timeout 2 s"):
            reward(torch.rand(2, 3, 16, 16), {})
        assert time.perf_counter() - begin < 5
    finally:
        stop(process)


@pytest.mark.parametrize("cue, needle", [
    ("302", r"answered HTTP 302 Found, a redirect to http://127\.0\.0\.1:\d+/elsewhere; give --reward the URL"),
    ("html500", r"HTTP 500 Internal Server Error: 500 Internal Server Error; Internal Server Error The server "
                r"encountered an internal error\."),
])
def test_answers_that_are_not_scores(cue, needle):
    """A redirect is an error naming where it points, never followed (a POST's 302 followed as a GET lost its images,
    and the GET's 64 scores would have been trained on); an HTML error page is quoted by its title and words, not as
    '<!doctype html>'."""
    process, port = faulty(cue)
    try:
        with pytest.raises(ServedRewardError, match=needle):
            ServedReward(f"http://127.0.0.1:{port}/brightness", timeout=10)(torch.rand(2, 3, 16, 16), {})
    finally:
        stop(process)


def test_reward_wait(capsys):
    """A server started after the run: without --reward-wait the start-up check tries once and says how to wait; with
    it, the check tries every 2 s, saying so, until the server answers."""
    port = free_port()
    url, images = f"http://127.0.0.1:{port}/brightness", torch.rand(2, 3, 16, 16)
    with pytest.raises(ServedRewardError, match="start its server .*--reward-wait S waits for one that starts"):
        ServedReward(url, timeout=5)(images, {})
    later = []
    late = threading.Timer(2.5, lambda: later.append(faulty(port=port)[0]))
    late.start()
    try:
        assert ServedReward(url, timeout=5, wait=60)(images, {}).shape == (2,)
    finally:
        late.join()
        for p in later:
            stop(p)
    assert "trying again in 2 s (try 2)" in capsys.readouterr().err


def test_served_reward_moved_on_resume(tmp_path, capsys):
    """A server that moved to another port: --resume takes the --reward that differs only in its address (the same
    reward: the run goes on), names it in a line, and the metrics keep the reward's first name, one series; a later
    resume without --reward asks the new address (inputs.json keeps it). Another change to --reward is refused."""
    prompts = write_example(tmp_path, ["a gray square | t.png", "another | t.png"])
    out = tmp_path / "run"
    first, port = faulty()
    url = f"http://127.0.0.1:{port}/brightness"
    try:
        grpo.main([*TINY, "--prompts", str(prompts), "--steps", "1", "--image-every", "0", "--reward", url,
                   "--out", str(out)])
    finally:
        stop(first)
    moved, new_port = faulty()
    new_url = f"http://127.0.0.1:{new_port}/brightness"
    try:
        expect_exit(["--resume", str(out), "--steps", "2", "--reward", f"{new_url},ssim"], 2,
                    "cannot take --reward", capsys)
        grpo.main(["--resume", str(out), "--steps", "2", "--reward", new_url])
        assert f"note: reward '{url}' is served at {new_url} now" in capsys.readouterr().err
        grpo.main(["--resume", str(out), "--steps", "3"])
    finally:
        stop(moved)
    lines = run_record(out)
    assert [line["step"] for line in lines] == [1, 2, 3] and all(f"reward/{url}" in line for line in lines)
    assert json.loads((out / "inputs.json").read_text())["served"] == {url: new_url}


def test_reward_server_serves_a_file(tmp_path):
    """tools/reward_server.py path/to/file.py:function serves it at /file.py:function, the URL it prints (it printed
    http://...//abs/path/file.py:function, which http.server cannot serve); GET / answers once it is loaded."""
    (tmp_path / "score.py").write_text("def brightness(images, example):\n    return images.mean(dim=(1, 2, 3))\n")
    process, port = start(str(ROOT / "tools" / "reward_server.py"), f"{tmp_path / 'score.py'}:brightness", "--port",
                          "0", "--device", "cpu")
    try:
        url = f"http://127.0.0.1:{port}/score.py:brightness"
        images = torch.rand(2, 3, 16, 16)
        assert torch.allclose(ServedReward(url)(images, {}), eight_bits(images).mean(dim=(1, 2, 3)), atol=1e-6)
        import urllib.request
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10) as answer:
            assert json.loads(answer.read()) == {"rewards": ["/score.py:brightness"]}
    finally:
        stop(process)


def test_hub_check_through_a_proxy(monkeypatch):
    """The start-up check that the hub can be reached asks the proxy the environment names (a cluster with no direct
    way out reaches the hub only through it: a direct try said 'offline?' there), and names it when it cannot."""
    from helpers import rewards
    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    listening.listen()
    try:
        monkeypatch.setenv("https_proxy", f"http://127.0.0.1:{listening.getsockname()[1]}")
        monkeypatch.delenv("no_proxy", raising=False)
        monkeypatch.delenv("NO_PROXY", raising=False)
        assert rewards.unreachable_hub("hub.invalid") is None  # no direct way to it; the proxy answers
        dead = free_port()
        monkeypatch.setenv("https_proxy", f"http://127.0.0.1:{dead}")
        assert rewards.unreachable_hub("hub.invalid") == f"hub.invalid (via proxy http://127.0.0.1:{dead})"
    finally:
        listening.close()
