import sys, os
sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
from fsdp2_compat.tooling.ranks import run_ranks
from fsdp2_compat.core import guards
from support import mixed_jobs
STEPS = ((("image",), ("text",)), (("text",), ("image",)))
ACCUM = ((("image", "text"), ("text", "image")),)
if __name__ == "__main__":
    fams = ["qwen2_5_vl", "qwen3_vl", "glm4v"]
    for fw in sys.argv[1:]:
        cases = [("fp32 every", "user", "fp32", "every", STEPS), ("fp32 deferred", "user", "fp32", "deferred", ACCUM),
                 ("bf16 deferred", "user", "bf16", "deferred", ACCUM)]
        res = run_ranks(mixed_jobs.per_family, 2, fw, fams, cases, timeout=600)
        for f in fams:
            for c, *_ in cases:
                errs = [r[f][c] for r in res]
                print("%s %s | %s | %s | grad_err %.2e | loss_err %.2e | dummies %s | err %s" % (
                    fw, guards.installed_version(fw) if fw != "accelerate" else guards.installed_version("accelerate"),
                    f, c, max(e.get("grad_err", -1) for e in errs), max(e.get("loss_err", -1) for e in errs),
                    [e.get("dummy_forwards") for e in errs], [e.get("error") for e in errs]), flush=True)
