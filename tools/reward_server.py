"""Serve rewards over HTTP, for `--reward http://HOST:PORT/NAME`: a reward in its own process, on its own device, with
its own packages (helpers/served_reward.py has the protocol; docs/rewards.md the commands).

    python tools/reward_server.py pickscore --device cuda:1                  # http://127.0.0.1:8000/pickscore
    python tools/reward_server.py clip@openai/clip-vit-large-patch14 mypkg.rewards:hps --port 8001
    python grpo.py --prompts my_prompts.txt --reward http://127.0.0.1:8000/pickscore=1,ssim=0.5

Each reward is served at /NAME: its name without `@checkpoint` (/pickscore, /clip), its import path
(/mypkg.rewards:hps), or for a file its file name and function (path/to/score.py:brightness at /score.py:brightness). A name of this project's rewards (ssim, shapes, pickscore, ...) needs its requirements in the
server's environment; a module:function of yours needs only torch, numpy and Pillow beside it. The rewards load when
the server starts (each that needs no target scores three gray images) and answer one request at a time. GET / lists them
once they are loaded: a job script can wait for it (until curl -sf http://127.0.0.1:8000/; do sleep 2; done), or the run
can (--reward-wait 300). `--port 0` takes a free port; the first line printed names the address. Ctrl-C or SIGTERM
stops it (exit 0).
"""
import argparse
import http.server
import json
import os
import signal
import sys
import threading
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the project's helpers/, when run as a script

from helpers.served_reward import read_request  # noqa: E402
from helpers.user_input import RewardError, parse_rewards  # noqa: E402


def load_rewards(names: list[str]) -> dict:
    """--reward-like names -> {path: guarded reward}: a name of the run's rewards (grpo.py's and helpers/rewards.py's,
    imported only for one) or module:function."""
    table = {}
    if any(":" not in name.split("@")[0] for name in names):
        import grpo  # (the repository is on sys.path: the insert above)
        from helpers import trainer
        table = trainer.reward_table(grpo)
    rewards = parse_rewards(",".join(names), table, "reward_server.py")
    return {served_path(name): fn for name, (fn, _) in rewards.items()}


def served_path(name: str) -> str:
    """The path a reward is served at: /NAME; a file's reward at /FILE.py:function (its folders left out: a path that
    starts with // is not one http.server serves)."""
    if ".py:" in name:
        file, _, function = name.rpartition(":")
        return f"/{Path(file).name}:{function}"
    return "/" + name


def handler(rewards: dict, device: str) -> type:
    """The request handler: POST /NAME scores one group with that reward on `device`; GET / lists the rewards."""
    lock = threading.Lock()  # one request at a time on the device

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def answer(self, status: int, content: dict) -> None:
            body = json.dumps(content).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            self.answer(200, {"rewards": sorted(rewards)})

        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))  # read whole: the connection stays
            reward = rewards.get(self.path)
            if reward is None:
                return self.answer(404, {"error": f"no reward at {self.path}; this server has {', '.join(rewards)}"})
            try:
                images, example = read_request(body)
            except (ValueError, TypeError, OSError) as error:
                return self.answer(400, {"error": f"bad request: {error}"})
            example = {k: v.to(device) if torch.is_tensor(v) else v for k, v in example.items()}
            try:
                with lock:
                    scores = reward(images.to(device), example)
            except Exception as error:  # a RewardError names the reward; the traceback goes to the server's stderr
                print(getattr(error, "details", "") or repr(error), file=sys.stderr, flush=True)
                return self.answer(500, {"error": str(error)})
            self.answer(200, {"scores": scores.tolist()})

        def log_message(self, format, *args):  # no line a request
            pass

    return Handler


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "),
                                     epilog=__doc__.split("\n\n", 2)[2].replace("\n", " "))
    parser.add_argument("rewards", nargs="+", help="rewards as --reward names them: ssim, pickscore@FOLDER, "
                                                   "module:function ...")
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=8000, help="the port (0: a free one)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where the rewards run (default: cuda if there is one)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM as Ctrl-C, while the rewards load too
    try:
        rewards = load_rewards(args.rewards)
        for path, reward in rewards.items():  # load and check each now (one that needs a target: at its first request)
            if not getattr(reward, "needs", ()):
                reward(torch.full((3, 3, 64, 64), 0.5, device=args.device),
                       {"prompt": "a test", "target": None, "source": None, "where": "reward_server.py"})
    except (ValueError, ImportError, RewardError) as error:
        raise SystemExit(f"reward_server.py: error: {error}") from None
    except KeyboardInterrupt:
        print("reward_server.py: stopped", flush=True)
        return
    try:
        server = http.server.ThreadingHTTPServer((args.host, args.port), handler(rewards, args.device))
    except OSError as error:
        raise SystemExit(f"reward_server.py: error: cannot listen on {args.host}:{args.port} ({error.strerror}); "
                         "pass another --port") from None
    host, port = server.server_address[:2]
    urls = ", ".join(f"http://{host}:{port}{path}" for path in rewards)
    print(f"reward_server.py: serving {urls} on {args.device} (Ctrl-C stops it)", flush=True)
    try:
        server.serve_forever()  # until Ctrl-C or SIGTERM (a KeyboardInterrupt here)
    except KeyboardInterrupt:
        pass
    server.server_close()
    print("reward_server.py: stopped", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
