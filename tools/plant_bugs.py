"""Plants each core line of issue 67's variants wrong, one at a time, in a throwaway clone of this repository's HEAD,
and runs the tests that guard it: each must fail (exit 1). Prints one line per planted bug; exits 1 if any survived.

    OMP_NUM_THREADS=1 python tools/plant_bugs.py     # about 10 minutes on 2 cores (the reset's tests run main)
    python tools/plant_bugs.py gate cluster           # only the plants whose name holds one of these words

'dino cosine not clamped' is caught only on builds where a copy's cosine rounds above 1 (torch 2.14.1 here)."""
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
PY = sys.executable
PLANTS = [
    ("dino cosine not clamped", "helpers/variants.py",
     "return (features @ features.T).clamp(-1, 1)", "return features @ features.T", "dino"),
    ("gardo_factor multiplies the negatives", "helpers/variants.py",
     "return torch.where(advantages < 0, torch.ones_like(d), relative)",
     "return torch.where(advantages < 0, relative, torch.ones_like(d))", "gardo"),
    ("gardo_factor not divided by the group's mean", "helpers/variants.py",
     "relative = torch.where(mean > 1e-6, d / mean.clamp(min=1e-6), torch.ones_like(d))",
     "relative = torch.where(mean > 1e-6, d, torch.ones_like(d))", "gardo"),
    ("nearest counts the sample itself", "helpers/variants.py",
     "return D.clone().fill_diagonal_(math.inf).min(-1).values", "return D.clone().min(-1).values", "gardo or cluster"),
    ("cluster: direct links only (no chain)", "helpers/variants.py",
     "        for _ in range(len(grid)):  # a chain has at most G - 1 links\n",
     "        for _ in range(0):\n", "cluster"),
    ("gate binds the certain, not the uncertain", "helpers/variants.py",
     "gated = (u > torch.quantile(", "gated = (u < torch.quantile(", "uncertain"),
    ("gate keeps A = 0 samples", "helpers/variants.py",
     ") & trained  # numpy's percentile", ")  # numpy's percentile", "uncertain"),
    ("ties ranked by place", "helpers/variants.py",
     "return 1 + above + (tied - 1) / 2", "return 1 + above", "rank or uncertain"),
    ("risk: grow and shrink swapped", "helpers/variants.py",
     "self.share = self.share * 1.1", "self.share = self.share * 0.9", "uncertain or risk or gardo"),
    ("reset: the anchor aliases the policy (no clone)", "helpers/variants.py",
     "self.anchor = [p.detach().clone() for p in self.trained()]",
     "self.anchor = [p.detach() for p in self.trained()]", "reset or gardo"),
    ("reset on the wrong step", "helpers/variants.py",
     "step - reference.last >= cfg.reference_reset_every", "step - reference.last > cfg.reference_reset_every",
     "reset or gardo"),
    ("reset count not restarted by the KL trigger", "helpers/variants.py",
     "step - reference.last >= cfg.reference_reset_every", "step % cfg.reference_reset_every == 0",
     "reset_schedule"),
    ("KL trigger reads the last update only", "helpers/parallel.py",
     '{"kl_peak": max(kls)}', '{"kl_peak": kls[-1]}', "reset_schedule"),
    ("last reset's step not saved", "helpers/variants.py",
     '"last": self.last}', "}", "reset_schedule or reference_reset"),
    ("an older checkpoint's last reset one step late", "helpers/variants.py",
     "reference.last = (step - 1) // cfg", "reference.last = step // cfg", "reset_schedule"),
    ("kl_peak taken over a NaN", "helpers/parallel.py",
     ' and math.isfinite(m["kl"])', "", "merge_metrics"),
    ("swap not restored", "helpers/variants.py",
     "            for p, v in zip(params, own):\n                p.copy_(v)\n",
     "            pass\n", "reset or gardo"),
    ("reference state not saved", "helpers/variants.py",
     'return {"weights": [gathered(w) for w in self.anchor], "last": self.last}', "return {}", "reset or gardo"),
]
rows = []
REPO = pathlib.Path(tempfile.mkdtemp()) / "repo"
subprocess.run(["git", "clone", "-q", str(ROOT), str(REPO)], check=True)
words = sys.argv[1:]
for name, path, old, new, k in PLANTS:
    if words and not any(w in name for w in words):
        continue
    f = REPO / path
    text = f.read_text()
    assert text.count(old) == 1, (name, text.count(old))
    f.write_text(text.replace(old, new))
    try:
        tests = ["tests/test_variants.py", "-k", k]
        r = subprocess.run([PY, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
                           cwd=REPO, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        last = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else r.stderr[-200:]
        failed = [l.split(" ")[1] for l in r.stdout.splitlines() if l.startswith("FAILED")]
        rows.append((name, "caught" if r.returncode == 1 else f"NOT caught (rc {r.returncode})", failed, last))
    finally:
        f.write_text(text)
    print(f"{rows[-1][1]:>9}: {name}  ({', '.join(rows[-1][2]) or rows[-1][3]})", flush=True)
shutil.rmtree(REPO.parent)
sys.exit(int(any(r[1] != "caught" for r in rows)))
