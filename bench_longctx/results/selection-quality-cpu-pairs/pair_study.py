"""Study (CPU, real SmolLM2 Q/K): does the sketch's first level keep its selection quality when it reads channels in
fixed pairs (what a channel-pair code layout, one 16-bit word = two channels of a token pair, would impose)?

    python -m bench_longctx.real_qk --tokens 8192 --steps 4 --out /tmp/qk8k.pt
    python bench_longctx/results/selection-quality-cpu-pairs/pair_study.py /tmp/qk8k.pt OUT.json

SketchTopK(min_candidates=0, coarse_factor=4 and 2): the fine pass refines only coarse_factor x k candidates, so the
first level's ranking decides what can be selected (with the default min_candidates=256 an 8K context's fine pass
covers every block and the first level would not matter). Channel choices, r = head_dim // 2 per kv head:
  top      the r channels of largest sum_g |q_gd| (today's read_channels_ref)
  adjacent the r / 2 pairs (2p, 2p + 1) of largest summed importance
  rope     the r / 2 pairs (p, p + D/2) of largest summed importance (the channels HF Llama's RoPE rotates together)
"""
import json
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/bench_longctx/", 1)[0])
import bench_longctx.selection_quality as sq  # noqa: E402
import eviction.sketch_channels as sc  # noqa: E402
from eviction.sketch_topk import SketchTopK  # noqa: E402

TOP = sc.read_channels_ref


def paired(partner: str):
    def read(q: torch.Tensor, num_kv_heads: int, num_channels: int) -> torch.Tensor:
        d = q.shape[1]
        imp = q.float().abs().view(num_kv_heads, -1, d).sum(1)  # [H, D]
        if partner == "adjacent":
            pair = imp.view(num_kv_heads, d // 2, 2).sum(-1)  # [H, D/2]
            top = torch.sort(pair, dim=1, descending=True, stable=True).indices[:, : num_channels // 2]
            idx = torch.cat((2 * top, 2 * top + 1), 1)
        else:
            pair = imp[:, : d // 2] + imp[:, d // 2:]
            top = torch.sort(pair, dim=1, descending=True, stable=True).indices[:, : num_channels // 2]
            idx = torch.cat((top, top + d // 2), 1)
        return torch.sort(idx, dim=1).values
    return read


def main(path: str, out: str) -> None:
    torch.set_num_threads(2)
    results = []
    for coarse in (4, 2):
        for name, reader in (("top", TOP), ("adjacent", paired("adjacent")), ("rope", paired("rope"))):
            sc.read_channels_ref = reader
            sq.SketchTopK = lambda coarse=coarse: SketchTopK(min_candidates=0, coarse_factor=coarse)
            t0 = time.time()
            res = sq.run(path, ["sketch"])
            for row in res["rows"]:
                if row["method"] == "sketch":
                    results.append({"channels": name, "coarse_factor": coarse, **row})
            print(f"coarse {coarse} {name}: {time.time() - t0:.0f} s", flush=True)
            for row in sorted((r for r in res["rows"] if r["method"] == "sketch"),
                              key=lambda r: (r["block_tokens"], -r["budget"])):
                print(f"  block {row['block_tokens']:>2} budget {row['budget_fraction']:>4}: mean vs oracle "
                      f"{row['mean_vs_oracle']:.3f}, worst {row['worst_vs_oracle']:.3f}", flush=True)
    with open(out, "w") as f:
        json.dump({"source": path, "rows": results}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
