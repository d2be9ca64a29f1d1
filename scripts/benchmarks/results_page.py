"""Write docs/benchmarks.md, the results page: today's figures for each question, from the JSONs in
docs/bench (their commands, machines, dates and commits are read from the files themselves).

    python scripts/benchmarks/results_page.py            # rewrite docs/benchmarks.md
    python scripts/benchmarks/results_page.py --plots    # and its pictures (matplotlib)
    python scripts/benchmarks/results_page.py --check    # exit 1 if docs/benchmarks.md is not what it would write

A new measurement replaces an entry of ``QUESTIONS`` below (the superseded JSON leaves docs/bench;
git history keeps it); tests/test_docs.py checks that the committed page is what this script writes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "docs" / "bench"
PAGE = ROOT / "docs" / "benchmarks.md"
E2E_PLOT = "end_to_end_vs_openclip_h100.png"
MULTI_GPU_PLOT = "multi_gpu_scaling_4xh200.png"

# Files written before the JSONs carried their own date and commit (meta.time, meta.git_commit):
# the date of the commit that added each file.
ADDED = {"loss_1gpu_h100.json": "2026-11-21", "loss_h100_bf16_c768.json": "2026-11-22",
         "loss_h100_fp32_c768.json": "2026-11-22", "loss_h100_1M_c768_strict.json": "2026-11-22",
         "loss_h200_1gpu_c768.json": "2026-11-22", "loss_h200_2gpu_c768.json": "2026-11-22"}

# Each question: what it asks, and the measurements that answer it today.
# kind: loss (benchmarks/loss.py), e2e (benchmarks/end_to_end.py), loader, stop, attention, mlp, towers,
# learning, layernorm.
QUESTIONS = [
    {
        "title": "The loss: speed and memory against Inf-CL and OpenCLIP",
        "text": "Symmetric CLIP loss, forward and backward with a learnable scale, on one GPU, c = 768. Useful "
                "TFLOP/s = 6 b^2 c / time. Extra GB = peak memory above the inputs and their gradients. "
                "`infcl` is megabatch's Triton backend, `ref_infcl` the Inf-CL package (inf_cl 1.2.1), "
                "`vanilla` the full logits matrix in torch, `ref_openclip` OpenCLIP 3.3's `ClipLoss` (local "
                "loss), `siglip` / `ref_siglip` the sigmoid loss, megabatch's and OpenCLIP's.",
        "picture": "kernels_bf16_c768_h100.png",
        "entries": [
            {"file": "loss_h100_bf16_c768.json", "kind": "loss"},
            {"file": "loss_h100_1M_c768_strict.json", "kind": "loss"},
            {"file": "loss_h100_fp32_c768.json", "kind": "loss"},
            {"file": "loss_1gpu_h100.json", "kind": "loss", "backends": ["ref_openclip"]},
            {"file": "siglip_loss_h100.json", "kind": "loss", "backends": ["siglip", "ref_siglip"], "dtypes": ["bf16"]},
        ],
    },
    {
        "title": "End to end: `python train.py` against OpenCLIP's trainer",
        "text": "One run per table, both trainers fed by the same JPEG shards and loader (16 or 14 workers, GPU "
                "decoding on our side), towers compiled on both sides (OpenCLIP 3.3 `--torchcompile --precision "
                "amp_bf16`, `--accum-freq` where the batch is sub-batched), every exact megabatch option on "
                "(`all-on`), bf16. Steady-state steps after warm-up. MFU counts the model's FLOPs x 3 against "
                "989 TFLOP/s.",
        "picture": E2E_PLOT,
        "entries": [
            {"file": "vit_b16_256_graphs_vs_openclip_h100.json", "kind": "e2e", "label": "ViT-B/16, batch 256"},
            {"file": "vit_b16_4k_patch_vs_openclip_h100.json", "kind": "e2e", "label": "ViT-B/16, batch 4k (8 x 512)"},
            {"file": "vit_b16_4k_options_vs_openclip_h100.json", "kind": "e2e",
             "label": "ViT-B/16, batch 4k (8 x 512), the defaults of the day (`all-on`, with "
                      "`model.attention=sdpa`) and `model.attention=auto model.gelu=tanh` (`auto-tanh`, tanh not "
                      "exact; its MFU was counted before the FLOP counter knew cuBLASLt's GELU GEMM: at its "
                      "samples/s the model's FLOPs make it 31.7%)"},
            {"file": "vit_b16_4k_auto_h100.json", "kind": "e2e",
             "label": "ViT-B/16, batch 4k (8 x 512): `model.attention=sdpa` (`sdpa-*`, the default then) against "
                      "`auto` (the default since), each twice, alternating"},
            {"file": "vit_l14_4k_auto_h100.json", "kind": "e2e",
             "label": "ViT-L/14, batch 4k (16 x 256): `model.attention=sdpa` (`sdpa-1`, the default then) against "
                      "`auto` (the default since)"},
            {"file": "vit_b16_32k_vs_openclip_h200.json", "kind": "e2e",
             "label": "ViT-B/16, batch 32k (64 x 512), H200"},
            {"file": "vit_l14_128_vs_openclip_h100.json", "kind": "e2e", "label": "ViT-L/14, batch 128"},
            {"file": "vit_l14_4k_direct_vs_openclip_h100.json", "kind": "e2e",
             "label": "ViT-L/14, batch 4k (16 x 256)"},
            {"file": "gradcache_32k_subbatch_vs_openclip_compiled_h100.json", "kind": "e2e",
             "label": "ViT-B/32, batch 32k (GradCache, sub-batch 1024 / auto)"},
            {"file": "vit_l14_32k_h100.json", "kind": "e2e",
             "label": "ViT-L/14, batch 32k (no OpenCLIP row: beyond an H100)"},
            {"file": "vit_l14_4k_flip_h100.json", "kind": "e2e", "label": "ViT-L/14, batch 4k, FLIP 0.5 (not exact)"},
        ],
    },
    {
        "title": "The towers' attention: Triton kernels against SDPA",
        "text": "`model.attention=triton` (`kernels/attention.py`, on the packed q/k/v projection) against PyTorch's "
                "SDPA (cuDNN) on the projection's strided views, eager (`sdpa`) and compiled by inductor "
                "(`sdpa-compiled`, as a compiled block runs it: the views' gradients assembled into the packed "
                "layout inside the graph), bf16, one call of each shape (b x S x heads x head dim, c: causal). "
                "Host: CPU microseconds to enqueue a forward + backward. What a compiled tower gains is in "
                "docs/performance.md.",
        "entries": [{"file": "attention_h100.json", "kind": "attention"}],
    },
    {
        "title": "The towers' MLP: the GELU in the GEMMs, and the tanh GELU",
        "text": "`c_proj(gelu(c_fc(x)))` at the towers' shapes (tokens x width x hidden: ViT-B/16 at 512 images, "
                "ViT-L/14 at 256, a text tower at 512 captions of 32 tokens), bf16. First the first GEMM and its "
                "GELU alone: cuBLAS's GEMM with its bias (`addmm`), that plus inductor's GELU kernel, cuBLASLt's "
                "tanh-GELU epilogue, cuBLAS's hidden gradient plus inductor's `gelu_backward`, and "
                "`kernels/mlp.py`'s GEMM with each epilogue at its tuned tiles; then the whole MLP, forward and "
                "backward: open_clip's module eager, compiled by inductor, and `model.fused_mlp=true`. The fused "
                "MLP was slower than cuBLAS + inductor and was removed (its code is in git at commit "
                "a2ff620).",
        "entries": [{"file": "mlp_tune_h100.json", "kind": "mlp"}],
    },
    {
        "title": "The towers with the tanh GELU",
        "text": "ViT-B/16, sub-batch 512, 32 caption tokens, compiled, bf16 (`towers.py`): each tower's graph-free "
                "forward (GradCache's first pass, where `model.gelu=tanh` runs cuBLASLt's GELU epilogue) and its "
                "replay (forward + backward), `model.gelu=erf` (the default) against `tanh`.",
        "entries": [{"file": "towers_gelu_vit_b16_h100.json", "kind": "towers"}],
    },
    {
        "title": "The residual add and LayerNorm in one kernel",
        "text": "`s = x + y`, `out = LN(s)` at the towers' shapes (tokens x width: ViT-B/16 at 512 images, ViT-L/14 "
                "at 256, ViT-bigG-14 at 128, two text towers at 512 captions of 32 tokens), bf16 (`layernorm.py "
                "--tune`): open_clip's add and norm eager, compiled by inductor, and `kernels/layernorm.py` at its "
                "tuned tiles; GB/s on the least each pass must move (two tensors read and two written forward, "
                "three and one backward). Then whole towers (`towers.py`), `model.fused_layernorm` off and on. "
                "It gave no gain in whole towers and was removed (its code is in git at commit a2ff620).",
        "entries": [{"file": "layernorm_tune_h100.json", "kind": "layernorm"},
                    {"file": "towers_addln_vit_b16_h100.json", "kind": "towers"},
                    {"file": "towers_addln_vit_l14_h100.json", "kind": "towers"}],
    },
    {
        "title": "The tanh GELU's effect on learning",
        "text": "The default digits run (`python train.py`: the tiny model, 500 steps of 128, CPU) with "
                "`model.gelu=erf` and `model.gelu=tanh`, five seeds each (`learning.py`): the training loss "
                "(mean over the seeds at each hundredth step, and over each run's last 100 steps) and the "
                "zero-shot top-1 on the held-out digits (360 images: one image is 0.28 points).",
        "entries": [{"file": "gelu_learning_digits_2core.json", "kind": "learning"}],
    },
    {
        "title": "The 1M step",
        "text": "One step of batch 1,048,576, ViT-B/32, `loss=infcl`, GradCache with data offload (the JPEG bytes "
                "kept in a spill file, re-decoded on the GPU in the replay), `trainer.sub_batch=auto`, compiled "
                "towers, on one GPU, as a run's later steps (the loader's queues filled first).",
        "entries": [{"file": "offload_1M_primed_tars_h100.json", "kind": "e2e", "label": "ViT-B/32, batch 1M, offload",
                     "phases": True}],
    },
    {
        "title": "The loader",
        "text": "The training loader alone: 256 px JPEG shards, ViT transforms, samples/s through the whole "
                "pipeline (`scripts/benchmarks/loader.py`), the shard split against the indexed split "
                "(random access by a cached tar index; cold: the indexes built in that pass).",
        "entries": [
            {"file": "loader_splits_2core.json", "kind": "loader"},
            {"file": "loader_splits_h100_host.json", "kind": "loader"},
        ],
    },
    {
        "title": "Several GPUs",
        "text": "As users launch them: `torchrun --nproc_per_node=N train.py` (ViT-B/32 unless named, "
                "`loss=infcl`, GPU decoding, `model.compile=true`, `trainer.sub_batch=auto`, 12 loader workers "
                "a rank, an epoch of 160k samples: a boundary every 4 steps at 32k) against OpenCLIP 3.3's own "
                "trainer under torchrun "
                "(`--local-loss --gather-with-grad --torchcompile --precision amp_bf16`, 1024 x `--accum-freq 8`, "
                "synthetic data: no JPEG decoding on its side). Samples/s over the steps after the first two "
                "(compilation): median, slowest and fastest; 'slowest / median' is the step-time ratio of the "
                "slowest step to the median one. MFU counts the model's FLOPs x 3 against the GPU's bf16 peak "
                "(OpenCLIP's with our FLOP count of the same architecture). Peak GB: the most any GPU had in use "
                "(nvidia-smi, both trainers). Then the Inf-CL ring on two GPUs of one host (NVLink) against one, "
                "per-GPU figures for the same global batch, bf16, c = 768.",
        "picture": MULTI_GPU_PLOT,
        "entries": [
            {"file": "multi_gpu_vit_b32_32k_4xh200.json", "kind": "multi_gpu",
             "label": "ViT-B/32, batch 32k, against OpenCLIP (one machine)"},
            {"file": "multi_gpu_vit_b32_32k_defaults_4xh200.json", "kind": "multi_gpu",
             "label": "The same with the next epoch's loader started early, tuning once per host and "
                      "`trainer.keep_graph=auto` (another 4 x H200 machine; the slow steps come every second "
                      "step, boundary or not, on 1 GPU too: the data phase of those steps, 0.3-0.9 s)"},
            {"file": "multi_gpu_vit_b32_32k_variants_4xh200.json", "kind": "multi_gpu",
             "label": "On that machine: 8 GB decoded ahead (`data.decode_ahead_gb=8`) and FSDP "
                      "(`trainer.parallel=fsdp`, `fsdp_reduce=auto`: once per step) against the row above"},
            {"file": "multi_gpu_vit_b32_32k_1gpu_waits_h200.json", "kind": "multi_gpu",
             "waits": "Step 3 starts the next epoch's loader (two steps before the boundary): forking its workers "
                      "from the training process is the wait not spent on decoding (0.41 s for 12 workers, 0.61 s "
                      "for 14). Step 5 is the boundary: the new epoch's decoding starts cold.",
             "label": "Where the slow steps' time goes: one H200, 8 steps of 4-step epochs, the data wait of each "
                      "step by cause (`metrics.jsonl`'s `data_wait_s`)"},
            {"file": "multi_gpu_vit_b32_32k_across_boundary_4xh200.json", "kind": "multi_gpu",
             "label": "ViT-B/32 at 32k on 4 GPUs with the GPU decoding reading ahead across the epoch boundary "
                      "(one decoding stream over the epochs' loaders; a fourth 4 x H200 machine)",
             "waits": "The boundary steps (5 and 9) no longer wait for the decoding. Steps 3 and 7 start the next "
                      "epoch's loader: forking its 12 workers from the training process (0.48 s) is what is left "
                      "of the boundary, and the slowest step's 1.74x."},
            {"file": "multi_gpu_vit_b32_32k_forkserver_thread_4xh200.json", "kind": "multi_gpu",
             "label": "ViT-B/32 at 32k, 4 GPUs against 1, as released: the loader's workers from a fork server, "
                      "the next epoch's loader started from a thread of its own three steps before the boundary "
                      "(a seventh 4 x H200 machine, 2026-11-27; 14 steps, three boundaries)",
             "waits": "No step waits for its data: the slowest step is 1.09x the median on 4 GPUs and 1.02x on 1. "
                      "4 GPUs give 4.02x one GPU's median (31.7k against 7.88k samples/s; 3.96x by the means of "
                      "steps 3-14). The next row is the same machine minutes later with the workers forked from "
                      "the training process: 1.66x, and a mean of 27.2k samples/s against 31.3k."},
            {"file": "multi_gpu_vit_b32_32k_fork_14_steps_4xh200.json", "kind": "multi_gpu",
             "label": "The same machine: the workers forked from the training process (`data.worker_start=fork`)"},
            {"file": "multi_gpu_vit_b32_32k_forkserver_thread_lead2_4xh200.json", "kind": "multi_gpu",
             "label": "Before that, on a sixth machine: started from its own thread but two steps before the "
                      "boundary, the new loader's first sub-batches came late (the boundary steps 5, 9 and 13 "
                      "waited 0.86-1.07 s): hence three"},
            {"file": "multi_gpu_vit_b32_32k_forkserver_4xh200.json", "kind": "multi_gpu",
             "label": "Earlier, on a fifth machine: the workers from the fork server, the loader started in the "
                      "step's thread two steps ahead",
             "waits": "Steps 3 and 7 start the next epoch's loader: 0.31-0.34 s of the main thread, against 0.61 s "
                      "forking the training process (next row, the same machine): the slowest step 1.25x the median "
                      "instead of 1.60x, and the mean of steps 2-10 29.3k samples/s instead of 27.3k. The median "
                      "is the same either way (30.2k, 30.3k): 4 GPUs give 3.84x one GPU's median here (3.77x by "
                      "the means), against 3.57x on the first machine, whose steps were all slower."},
            {"file": "multi_gpu_vit_b32_32k_fork_4xh200.json", "kind": "multi_gpu",
             "label": "The same machine, minutes later: the workers forked from the training process "
                      "(`data.worker_start=fork`, as before)"},
            {"file": "multi_gpu_vit_b16_32k_4xh200.json", "kind": "multi_gpu",
             "label": "ViT-B/16, batch 32k, 4 GPUs against 1 (a third 4 x H200 machine; 7 steps, the first two "
                      "left out; step 3 starts the next epoch's loader, step 5 is the boundary)"},
            {"file": "multi_gpu_vit_b32_256k_4xh200.json", "kind": "multi_gpu",
             "label": "ViT-B/32, batch 256k, 4 GPUs (that machine; an epoch of 600k samples: 5 steps, the first "
                      "two left out; 1 and 2 GPUs not run)"},
            {"file": "multi_gpu_vit_b32_256k_1gpu_4xh200.json", "kind": "multi_gpu", "phases": True,
             "label": "ViT-B/32, batch 256k, 1 GPU (one of a tenth 4 x H200 machine, 2026-11-28; 4 steps, the "
                      "first left out): 7.64k samples/s; the 4-GPU run above (another machine) gave 29.8k, 3.90x. "
                      "The data phase (4.9-5.9 s a step) is the wait for the GPU decoding"},
            {"file": "multi_gpu_vit_b16_256k_4xh200.json", "kind": "multi_gpu", "phases": True,
             "label": "ViT-B/16, batch 256k, 4 GPUs (an eleventh 4 x H200 machine, 2026-11-28; 4 steps, the first "
                      "left out): 10.5k samples/s, 4.10x one GPU's 2.56k at 256k (the 2 x H200 machine below); the "
                      "data phase (2.1-2.7 s a step) is the wait for the GPU decoding"},
            {"file": "multi_gpu_vit_b16_256k_2gpu_2xh200.json", "kind": "multi_gpu", "phases": True,
             "label": "ViT-B/16, batch 256k, 2 GPUs (a 2 x H200 machine, 32 cores, 2026-11-28; 4 steps, the first "
                      "left out): 5.21k samples/s, 2.03x the same machine's one GPU (next row); the data phase "
                      "(5.1-6.3 s a step) is the wait for the GPU decoding"},
            {"file": "multi_gpu_vit_b16_256k_1gpu_2xh200.json", "kind": "multi_gpu", "phases": True,
             "label": "ViT-B/16, batch 256k, 1 GPU (that machine, minutes later; 3 steps, the first left out): "
                      "2.56k samples/s. Per sample a GPU the phases are the 2-GPU run's: data and encode together "
                      "28.2-28.4 s against 12.9-13.3 s for half the samples (how the host's clock splits them "
                      "between the two differs: 3.2-4.4 s and 23.8-25.2 s here, 5.1-6.3 s and 6.9-8.2 s there), "
                      "replay 72.8-73.0 s against 36.4-36.5 s"},
            {"file": "multi_gpu_vit_b32_256k_2gpu_4xh200.json", "kind": "multi_gpu", "phases": True,
             "label": "ViT-B/32, batch 256k, 2 GPUs (two of an eighth 4 x H200 machine, 2026-11-27; 4 steps, the first "
                      "left out): 16.0k samples/s, 2.04x the 1-GPU median at 32k on the 2 x H200 machine (7.9-8.1k on "
                      "every H200 measured) and 0.54x the 4-GPU figure above; the data phase (1.0-2.6 s a step) is "
                      "the wait for the GPU decoding"},
            {"file": "multi_gpu_vit_bigg_512_fsdp_ddp_4xh200.json", "kind": "multi_gpu",
             "label": "ViT-bigG-14, batch 512, 4 GPUs: DDP against FSDP (`fsdp_reduce=auto`: once per step, the "
                      "weights kept gathered through the step), `trainer.sub_batch=auto` (64 for both), "
                      "`model.compile=false`; 6 steps, the first two left out (the DDP run's last checkpoint, 43 s, "
                      "ran past the harness's 150 s limit after its steps)"},
            {"file": "multi_gpu_vit_bigg_512_fsdp_ddp_12_steps_4xh200.json", "kind": "multi_gpu",
             "label": "The same again with 12 steps, the first two left out (the eleventh machine, minutes after the "
                      "ViT-B/16 run above): FSDP 354 against DDP's 415 samples/s, 0.85x, so the 10% target is "
                      "missed. Steps 3-12, FSDP against DDP (s, min-max): phase 1 0.32-0.47 against 0.29-0.36, "
                      "replay 0.87-1.10 against 0.84-1.01, optimizer 0.05-0.10 against 0.02-0.03 (the whole "
                      "gradient reduce-scattered, then AdamW on the shards). Measured before 2fef97a, which "
                      "stops the root group's weights (the fp32 token embedding, 253 MB) being gathered again "
                      "for every pass of the step; on 2 GPUs after it (below): 0.91x"},
            {"file": "multi_gpu_vit_bigg_256_fsdp_ddp_2xh200.json", "kind": "multi_gpu",
             "label": "ViT-bigG-14 after 2fef97a (the root group gathered once a step), batch 256 on 2 GPUs: 128 a "
                      "GPU as 512 on 4 (the 2 x H200 machine above, 2026-11-28; 12 steps, the first two left out): "
                      "FSDP 187 against DDP's 205 samples/s, 0.91x, within the 10% target, in 89 GB against 109. "
                      "Steps 3-12, FSDP against DDP (s, min-max): phase 1 0.31-0.61 against 0.29-0.42, replay "
                      "0.84-1.02 against 0.83-0.94, optimizer 0.05-0.10 against 0.02-0.03. FSDP's slowest step "
                      "(1.31x its median) is step 3; its steps 4-12 ran at 168-200 samples/s"},
            {"file": "multi_gpu_vit_bigg_512_fsdp_ddp_regather_4xh200.json", "kind": "multi_gpu",
             "label": "The same earlier that morning (another 4 x H200 machine), FSDP gathering each group's "
                      "weights again for every pass of the step"},
            {"file": "multi_gpu_vit_b32_1m_4xh200.json", "kind": "multi_gpu", "phases": True,
             "label": "ViT-B/32, batch 1M, `trainer.offload=true` (4 steps, the first left out)"},
            {"file": "multi_gpu_vit_b32_1m_readahead_4xh100.json", "kind": "multi_gpu", "every_step": True,
             "label": "The same with the next step's samples read during this step's loss and replay "
                      "(`trainer.prefetch_gb=8`), 4 x H100 (64 cores), 3 steps (the run's limit stopped the fourth), "
                      "the first left out: 52.5 and 41.9 s a step; the data phase 0.4-0.8 s a step against 7.6-10.0 s "
                      "without read-ahead (4 x H200, above). No baseline from this machine: the run without "
                      "read-ahead was stopped by the command's limit before its first step ended. The 25 s target is "
                      "missed: the replay alone takes 26.4-28.7 s (262k samples a GPU encoded again with a graph, "
                      "sub-batch 1024, no graph kept: room for none at this batch). The encode phase took 22.0 and "
                      "19.6 s in the first two steps and 9.8 s in the third (9.4-11.9 s on the H200s): two steady "
                      "steps do not say why"},
            {"file": "multi_gpu_vit_b32_1m_readahead_pair_4xh200.json", "kind": "multi_gpu", "every_step": True,
             "label": "Both in one command on one machine (a ninth 4 x H200 machine, 2026-11-28; 3 steps each, "
                      "the first left out): with `trainer.prefetch_gb=8` 37.4 s a step (28.0k samples/s) against "
                      "44.3 s (23.7k) without, 1.18x; now the default with offload where the images decode on the "
                      "GPU. The reading's waits went from 3.6-7.5 s a step to 2-3 ms; what is left of the data "
                      "phase (5.4-5.8 s in the steady steps) is the wait for the first pass's GPU decoding. The 25 s "
                      "target is missed: 37.4 s, of which the replay is 23.1 s"},
            {"file": "multi_gpu_vit_b32_256k_offload_decode_ahead_h200.json", "kind": "multi_gpu",
             "every_step": True,
             "label": "Is the 1M step's data phase on its critical path? One GPU doing a 1M rank's share (256k, "
                      "offload, read-ahead as default) with 40 GB decoded ahead instead of 3.8 (one H200, "
                      "2026-11-28; 2 steps, the first left out; no baseline beside it: compare the phases). "
                      "The data phase fell to 0.13 s (no wait for decoding at all) but the encode phase rose to "
                      "9.8 s: the two together, 10.0 s, are what they were at 1M on 4 GPUs with 3.8 GB (10.0-10.2 s) "
                      "and on one GPU at 256k without offload (10.5-11.1 s). The wait was the host waiting for "
                      "the GPU's first pass through the waits for decoding, not time the GPU lost: the 1M step is "
                      "compute-bound. Each GPU's share is 16.6 PFLOP: the first pass 3.9, the replay 11.6, the loss "
                      "1.1 (four 256k x 1M x 512 GEMMs: the logits, their recomputation and two gradients). At "
                      "37.4 s that is 45% of the bf16 peak; 25 s asks 67%, where the fastest phase, the replay, "
                      "runs at 51% and the first pass at 39%"},
            {"file": "multi_gpu_vit_b32_32k_2xh200.json", "kind": "multi_gpu",
             "label": "ViT-B/32, batch 32k, 2 GPUs against 1 (2 x H200 of one host, 32 cores, 2026-11-27, commit "
                      "05fa62f; 12 steps, the first two left out): 16.1k against 8.14k samples/s, 1.97x; the "
                      "slowest step 1.08x the median on 2 GPUs, 1.04x on 1"},
            {"file": "multi_gpu_vit_b16_32k_2xh200.json", "kind": "multi_gpu",
             "label": "ViT-B/16, batch 32k, 2 GPUs against 1 (the same machine; 6 steps, the first two left out): "
                      "5.45k against 2.70k samples/s, 2.02x; the slowest step 1.01x the median on 2 GPUs, 1.02x "
                      "on 1"},
            {"file": "multi_gpu_openclip_largest_2xh200.json", "kind": "multi_gpu", "memory": True,
             "label": "The largest batch OpenCLIP 3.3 reaches on 2 H200s (ViT-B/32, 1024 x `--accum-freq`, its "
                      "batches tried from the largest down: `--openclip-largest`; a second 2 x H200 machine, "
                      "2026-11-28): "
                      "128k ran out of memory at its first step (a 32 GiB allocation, the 64k x 128k fp32 logits of "
                      "its local loss, with 122.9 GB in use); 64k ran, 4.91k samples/s. Its logits grow as the batch "
                      "squared over the GPUs, so 4 GPUs would reach an estimated 1.4x further (not run). Ours on 2 "
                      "GPUs: 16.0k samples/s at 256k, 14.6-16.1k at 32k (rows above); on 4, 1M at 28.0k"},
            {"file": "loss_h200_1gpu_c768.json", "kind": "loss"},
            {"file": "loss_h200_2gpu_c768.json", "kind": "loss"},
            {"file": "siglip_loss_2xh200.json", "kind": "loss", "backends": ["siglip", "ref_siglip", "infcl"]},
        ],
    },
    {
        "title": "Trainer options: EMA, Muon, hard negatives",
        "text": "What each option costs a step, as users launch it: `python train.py` on one GPU through the "
                "multi-GPU harness (`--gpus 1`; JPEG shards, GPU decoding, `model.compile=true`, "
                "`trainer.sub_batch=auto`), each option a variant beside the plain run in one call. The "
                "phases are the medians of steps 3-8 (host seconds: `optimizer` and `ema` are what the host "
                "spends queueing them; the step's samples/s carries their GPU time).",
        "entries": [
            {"file": "options_ema_vit_b32_32k_h200.json", "kind": "multi_gpu", "phases": True,
             "label": "`ema.decay=0.9999` against none: ViT-B/32, batch 32k, one H200 (the average of 151M "
                      "weights, fp32, updated after each step): 7,817 against 7,971 samples/s (-1.9%; the "
                      "update queues in 0.6 ms, and the difference sits in the encode phase, 1.39 against 1.30 s, "
                      "which the average does not touch)"},
            {"file": "options_muon_vit_b16_4k_h200.json", "kind": "multi_gpu", "phases": True,
             "label": "`optim=muon` (torch's Muon on the blocks' matrices, AdamW on the rest) against AdamW "
                      "(fused): ViT-B/16, batch 4k, one H200: the optimizer phase 58 ms against 6 ms, the step "
                      "1.52 against 1.48 s (2,694 against 2,766 samples/s, -2.6%)"},
            {"file": "options_negatives_vit_b32_32k_h200.json", "kind": "multi_gpu", "phases": True,
             "label": "Hard negatives (`data.train.negatives_key=json:negatives`, K a sample: K x 32k more "
                      "captions through the text tower and K x 32k more columns of the image->text softmax) "
                      "against none: ViT-B/32, batch 32k, one H200, 4 steps, the first left out (K = 16: 2 steps "
                      "in the harness's 175 s). Measured before the negatives were sorted by length "
                      "(97d1c09): every chunk of them ran at the full 77-token context, hence the replay's "
                      "4.6 / 10.1 / 32 s and the 106 GB; not re-measured since"},
        ],
    },
    {
        "title": "Distillation: a teacher's term at any batch",
        "text": "`distill.teacher` (docs/models.md): the loss alone, then the step as users launch it. The loss: "
                "`infcl` with and without the distillation term (`infcl_distill`: the fused Triton kernels since "
                "a5bb2fe; `infcl_distill_blocks` and the first table: the term in row blocks of torch GEMMs) "
                "against OpenCLIP 3.3's `DistillClipLoss` (its trainer's "
                "`--distill-model`: the student's and the teacher's b x b logits, both directions), fp32 features "
                "holding bf16 values as GradCache's phase 2 gives them, student width 512, random teacher features "
                "of width 768 (ViT-L/14's), forward + backward on one H200; 'useful TFLOP/s' counts the "
                "contrastive loss's FLOPs only. OpenCLIP's runs out of memory from 64k; ours held 5.6-6.8 GB "
                "beyond the features up to 256k in row blocks (1M predicted at ~3 minutes: not run); the fused "
                "kernels run 1M in 34 s with 6.2 GB. "
                "The step: ViT-B/32 at 32k on one H200 through the multi-GPU harness (`--gpus 1`), distilled from "
                "a ViT-L/14 teacher (random weights) against the plain run, 4 steps, the first left out.",
        "entries": [
            {"file": "distill_loss_h200.json", "kind": "loss"},
            {"file": "distill_fused_one_direction_h200.json", "kind": "loss",
             "label": "The term in fused kernels (a5bb2fe: one pass per direction) against the row blocks, one "
                      "warm H200: at 256k 3.97 against 11.13 s (the term 2.93 against 10.09 s beside infcl's "
                      "1.04 s), 3.2 against 6.8 GB; 1M in 63.6 s"},
            {"file": "distill_fused_loss_h200.json", "kind": "loss",
             "label": "The fused kernels today (9cfde76), another H200: both directions in one pass over the "
                      "student's and the teacher's tiles, and on one process both terms from the same passes (the "
                      "student's log-sum-exps are the contrastive loss's; one G of both into one pair of GEMMs). "
                      "The distilled loss against infcl alone: 0.032 against 0.017 s at 32k, 2.06 against 1.07 s at "
                      "256k, 34.1 against 17.3 s at 1M (6.2 GB beyond the features at 1M): the term adds about what "
                      "the contrastive loss costs, its teacher's tiles (width 768) read in both passes"},
            {"file": "distill_vit_b32_32k_h200.json", "kind": "multi_gpu", "phases": True,
             "label": "ViT-B/32 at 32k distilled from ViT-L/14 (`distill.teacher=ViT-L-14`, bf16, eager) against "
                      "the plain step, one H200: 1,439 against 8,285 samples/s. The teacher's forward pass is the "
                      "encode phase's difference, 19.8 against 1.2 s (the teacher, ~5.3 PFLOP at 32k, runs "
                      "uncompiled at ~290 TFLOP/s); the term adds 0.14 s to the loss phase (0.16 against 0.02 s); "
                      "the replay is unchanged (2.7 s); rank 0 allocated at most 84 against 78 GB (97.5 against "
                      "75.5 GB in use, nvidia-smi)"},
            {"file": "distill_compiled_teacher_8k_h100.json", "kind": "multi_gpu", "phases": True,
             "label": "A compiled teacher (`distill.compile`, default with `model.compile=true`): ViT-B/32 at 8k from "
                      "ViT-L/14 on one H100, 1,795 samples/s; the encode phase (student and teacher, no graph) 3.8 s, "
                      "the loss 0.005 s, the replay 0.75 s; the first step 36.6 s (the teacher compiling). The eager "
                      "teacher's run, first on a cold host, passed its 150 s limit before its first step ended "
                      "(the student's compilation, 46 s, and the distillation kernels' tuning for this GPU, ~80 s): "
                      "no comparison on this machine"},
            {"file": "distill_stored_vit_b32_32k_h200.json", "kind": "multi_gpu", "phases": True,
             "label": "The same with stored embeddings (`distill.teacher=stored data.train.teacher_key=teacher.npy`: "
                      "each sample's ViT-L/14 embeddings in its shard, written by `scripts/make_shards.py teacher`) "
                      "against the plain step reading the same shards, another H200, 6 steps, the first two left "
                      "out: 7,605 against 7,983 samples/s (-4.7%); the loss phase 0.16 against 0.02 s, encode and "
                      "replay as without (the first step's loss phase, 26.6 s, tunes the loss kernels for both runs)"},
            {"file": "distill_stored_vit_b32_1m_pair_h200.json", "kind": "multi_gpu", "every_step": True,
             "label": "ViT-B/32 at 1M on one H200, the plain step and the step distilled from stored ViT-L/14 "
                      "embeddings (`distill.teacher=stored`) on the same shards, one machine (`trainer.offload=true`, "
                      "`trainer.sub_batch=auto`: 2048; one cold step each): 165.2 against 191.7 s (6,347 against "
                      "5,471 samples/s), 1.16x the plain step. The loss phase is most of the difference, 36.7 "
                      "against 18.5 s: both terms over 1M x 1M in the fused kernels, the teacher's tiles (width "
                      "768) read beside the student's in both passes; the encode phase 29.1 against 24.4 s and the "
                      "data phase 34.7 against 31.1 s (3 GB of fp16 embeddings read, made float32 in the workers "
                      "before 12bc61f); the replay is unchanged (91.0 s). Rank 0 allocated at most 94.3 against "
                      "81.5 GB"},
            {"file": "loader_stored_teacher_2core.json", "kind": "loader",
             "label": "The loader's workers with stored embeddings (`data.decode=gpu`: the workers' part, on the "
                      "2-core machine): where the 1M stored step's data phase grew (3.6 s, its look-ahead waiting 21.2 "
                      "against 13.4 s for the workers). Each sample's `.npy` was parsed by `np.load` (~26 us) and "
                      "made float32; since 12bc61f its header, once met, keys a read of the bytes after it and the "
                      "embeddings stay float16 to the device: 0.81-0.83 of the plain shards' samples/s against "
                      "0.66-0.72. Not measured on a GPU host yet"},
            {"file": "distill_peak_memory_vs_openclip_h100.json", "kind": "multi_gpu", "memory": True,
             "label": "Peak memory against OpenCLIP's `--distill-model`, one H100 80GB (a cold host): ViT-B/32 "
                      "distilled online from ViT-L/14 (random weights). OpenCLIP 3.3 (`--torchcompile`, `amp_bf16`, "
                      "the per-GPU batch at once: its distillation takes no `--accum-freq`) ran out of memory at "
                      "2k, 3k and 4k: its largest batch on this GPU is below 2k (smaller ones not tried). Ours at 4k: "
                      "36.6 GB allocated by rank 0 (47.0 GB in use); its one step's 71.4 s loss phase is the "
                      "distillation kernels' tuning for the H100, not a step time (the run's 150 s limit stopped it "
                      "after that step)"},
            {"file": "distill_online_vit_b32_4k_h100.json", "kind": "multi_gpu", "every_step": True,
             "label": "Ours at 4k on another cold H100, the same settings, 4 steps: 1,352 samples/s after the first, "
                      "37.3 GB allocated (47.0 GB in use), sub-batch 1024; the teacher's eager forward is most of the "
                      "2.6 s encode phase of a 3.0 s step. The first step's 56.7 s loss phase tuned the distillation "
                      "kernels; their tables for the H100 now ship in `kernels/tuned.json`"},
            {"file": "distill_openclip_largest_h200.json", "kind": "multi_gpu", "memory": True,
             "label": "OpenCLIP's largest `--distill-model` batch on one H200 (141 GB), its batches tried from the "
                      "largest down (`--openclip-largest`): 4k ran out of memory, 3072 ran"},
            {"file": "distill_vs_openclip_3072_h200.json", "kind": "multi_gpu", "with_memory": True,
             "label": "At that batch, 3072, on one H200 (one machine, 6 steps, the first left out): OpenCLIP 1,376 "
                      "samples/s with 132.6 GB in use. Ours by default (`trainer.sub_batch=auto` fits the whole "
                      "batch in one pass) 1,407 samples/s (1.02x) with 124.9 GB allocated (133.2 GB in use); with "
                      "`trainer.sub_batch=256`, 1,175 samples/s (0.85x) with 12.2 GB allocated (15.3 GB in use), "
                      "8.7x less than OpenCLIP. The encode phase (student and teacher without a graph; the "
                      "teacher eager) is 2.0 of the sub-batched step's 2.6 s"},
        ],
    },
    {
        "title": "Captions: CoCa's caption loss at any batch",
        "text": "`loss.caption_weight` (docs/models.md): CoCa ViT-B/32 (`model=openclip model.arch=coca_ViT-B-32`, "
                "random weights) on one H200 through the multi-GPU harness (`--gpus 1`, `trainer.sub_batch=auto`, "
                "`model.compile=true`), the first step left out, beside OpenCLIP 3.3's own trainer on CoCa "
                "(`--coca-caption-loss-weight 2`, its default) at the batches it was tried at. Then learning: the "
                "tiny CoCa (`model=tiny_coca`) on the embedded digits, 1000 steps of 128, with the caption loss "
                "and without, three seeds: the zero-shot top-1 and the share of the 360 held-out scans whose "
                "beam-search caption (`scripts/caption.py`) names the scan's digit (word or numeral) and no other.",
        "entries": [
            {"file": "coca_vit_b32_32k_h200.json", "kind": "multi_gpu", "phases": True,
             "label": "32k, the caption pass eager: contrastive only (`loss.caption_weight=0`) 5,811 against "
                      "1,776 samples/s with the caption loss (`loss.caption_weight=2.0`); the replay 4.1 against "
                      "16.2 s (sub-batch 2048 against 512: the decoder's logits, 140 MB a sample). OpenCLIP at 8k "
                      "(1024 x `--accum-freq 8`) logged no step in 190 s"},
            {"file": "coca_caption_compiled_vit_b32_32k_h200.json", "kind": "multi_gpu", "phases": True,
             "label": "32k with the caption pass compiled (ac949ed): 2,448 samples/s (+38%), the replay 11.4 s, "
                      "rank 0's peak 56 against 83 GB; the caption loss is 58% of the step (13.4 against 5.6 s "
                      "without it). "
                      "OpenCLIP: 2k (1024 x `--accum-freq 2`) ran out of memory (28 GB more asked at 125 GB: it "
                      "concatenates every micro-batch's [b, 76, 49408] logits and recomputes the whole batch's "
                      "caption loss in each micro-batch's replay); 1k without accumulation aborted at 125 GB"},
            {"file": "coca_caption_vit_b32_256k_h200.json", "kind": "multi_gpu", "phases": True,
             "label": "256k with the caption loss, one step after the first: 2,278 samples/s (115 s a step), "
                      "rank 0's peak 90 GB (118 GB in use, nvidia-smi)"},
            {"file": "coca_openclip_512_h200.json", "kind": "multi_gpu",
             "label": "OpenCLIP 3.3 on CoCa ViT-B/32 at 512, the largest batch it reached on this GPU (1k aborted "
                      "and `--accum-freq` ran out of memory, above), `--torchcompile`, 5 steps, the first left out: "
                      "1,618 samples/s, 68 GB. megabatch's 32k with the same loss runs 1.51x that (2,448) and its "
                      "256k 1.41x (2,278)"},
            {"file": "coca_openclip_512_eager_h200.json", "kind": "multi_gpu",
             "label": "The same without `--torchcompile`: 1,260 samples/s, 76 GB"},
            {"file": "coca_learning_digits_h200.json", "kind": "learning"},
        ],
    },
    {
        "title": "Evaluation: one GPU and several",
        "text": "`scripts/benchmarks/eval_suite.py`: `scripts/evaluate.py` on one GPU and `torchrun "
                "--nproc_per_node=N scripts/evaluate.py` on the same ViT-B/16 checkpoint (trained a few hundred steps "
                "on the digits; it had not left chance, so its features are near-tied) and the same sets, "
                "real scans on a 64 px canvas in "
                "CLIP_benchmark's layouts: zero-shot (10,000 images), multi-label (3,000, mAP), retrieval (3,000 "
                "images, five captions each), selection (2,000) and a linear probe (20,000 training images, the "
                "zero-shot images as its test split). Then the probe again, reading the features the first runs "
                "kept beside the checkpoint. Each cell: the set's seconds (model load left out) and its main number.",
        "entries": [
            {"file": "eval_suite_vit_b16_2xh200.json", "kind": "eval_suite",
             "label": "2 x H200 (32 cores), commit e5269a5 (every set's images opened by loader workers, the "
                      "probe's search shared out over the ranks): the suite in 103.9 s on one GPU (175.5 s at "
                      "815a23f, images decoded in the main process) and 87.0 s on two; the probe 65.8 s cold on one "
                      "GPU, 31.0 s from kept features (20.9 s on two). The checkpoint (300 steps at lr 5e-4) stayed "
                      "at loss ln 256: its features are near-tied, so one retrieval hit in 3,000 and 6e-4 of mAP "
                      "differ between one GPU and two (float noise breaking ties); every other number is equal"},
            {"file": "eval_suite_vit_b16_4xh200.json", "kind": "eval_suite",
             "label": "4 x H200 (64 cores), commit b706a17, before retrieval and selection had loader workers: one "
                      "GPU passed its 150 s limit (those sets decoded in the main process, 3-8x slower on this host); "
                      "four GPUs finished every set but a rank aborted at exit (its heartbeat thread left running: "
                      "fixed in 3e796e2, covered by a torchrun test; not re-measured on 4 GPUs, none lent since)"},
        ],
    },
    {
        "title": "Stopping: a signal to a checkpoint on disk",
        "text": "ViT-L/14 with AdamW's state (a 5.13 GB `last.pt`), SIGTERM after step 3: seconds from the signal "
                "to the process's exit with the checkpoint written and fsync'ed.",
        "entries": [
            {"file": "stop_vit_l14_python_workers_h100.json", "kind": "stop"},
            {"file": "stop_vit_l14_torchrun_workers_h100.json", "kind": "stop"},
            {"file": "stop_vit_l14_torchrun_launcher_h100.json", "kind": "stop"},
        ],
    },
]


def load(name: str) -> dict:
    return json.loads((BENCH / name).read_text())


def machine(meta: dict) -> str:
    gpu = meta.get("gpu")
    if gpu in (None, "None"):
        host = meta.get("host") or {}
        cpus = host.get("cpus") if isinstance(host, dict) else None
        return f"CPU only ({cpus} cores)" if cpus else "CPU only"
    gpus = int(meta.get("gpus") or 1)
    return f"{gpus} x {gpu}" if gpus > 1 else f"1 x {gpu}"


def provenance(name: str, meta: dict) -> str:
    date = (meta.get("time") or "")[:10] or ADDED.get(name, "undated")
    commit = (meta.get("git_commit") or "")[:7]
    if (meta.get("git_commit") or "").endswith("+dirty"):  # measured with changes not yet committed
        commit += " with uncommitted changes"
    command = meta.get("command") or "(not recorded)"
    if "scripts/" in command:  # as the benchmark is run today (scripts/bench_X.py moved to scripts/benchmarks/)
        command = command[command.index("scripts/"):]
    for old, new in (("bench_offload.py", "benchmarks/end_to_end.py"), ("bench_loss.py", "benchmarks/loss.py"),
                     ("bench_loader.py", "benchmarks/loader.py")):
        command = command.replace(f"scripts/{old}", f"scripts/{new}")
    if command.startswith("scripts/"):
        command = "python " + command
    where = f"{machine(meta)}, {date}" + (f", commit {commit}" if commit else "")
    return f"[`{name}`](bench/{name}): {where}; `{command}`"


def batch_name(batch: int) -> str:
    for size, suffix in ((2**20, "M"), (2**10, "k")):
        if batch >= size and batch % size == 0:
            return f"{batch // size}{suffix}"
    return f"{batch:,}"


def loss_table(data: dict, entry: dict) -> list[str]:
    rows = ["| backend | dtype | batch | time | useful TFLOP/s | extra GB |", "|---|---|---|---|---|---|"]
    for row in data["results"]:
        if entry.get("backends") and row["backend"] not in entry["backends"]:
            continue
        if entry.get("dtypes") and row["dtype"] not in entry["dtypes"]:
            continue
        if row.get("status") == "ok":
            time = row["time_s"]
            shown = f"{time * 1000:.1f} ms" if time < 1 else f"{time:.2f} s"
            rows.append(f"| `{row['backend']}` | {row['dtype']} | {batch_name(row['batch'])} | {shown} | "
                        f"{row['useful_tflops']:.0f} | {row['extra_gb']:.2f} |")
        elif not str(row.get("status", "")).startswith("skipped"):
            rows.append(f"| `{row['backend']}` | {row['dtype']} | {batch_name(row['batch'])} | "
                        f"{row.get('status')} | | |")
    return rows


def e2e_rows(data: dict) -> tuple[list[dict], dict | None]:
    ours = [row for row in data["results"] if row.get("system") == "megabatch"]
    theirs = next((row for row in data["results"] if str(row.get("system", "")).startswith("openclip")), None)
    return ours, theirs


def e2e_table(data: dict, entry: dict) -> list[str]:
    ours, theirs = e2e_rows(data)
    rows = ["| trainer | variant | sub-batch | s / step | samples/s | vs OpenCLIP | MFU | peak GPU GB |",
            "|---|---|---|---|---|---|---|---|"]
    base = theirs.get("samples_per_s") if theirs else None
    for row in ours:
        ratio = f"**{row['steady_samples_s'] / base:.2f}x**" if base else "-"
        setting = row.get("sub_batch_setting")
        sub = f"{row['sub_batch']}" + (" (auto)" if setting == "auto" else "")
        rows.append(f"| megabatch | {row.get('variant') or 'all-on'} | {sub} | {row['steady_step_s']:.3f} | "
                    f"{row['steady_samples_s']:,.0f} | {ratio} | {row['mfu'] * 100:.1f}% | {row['peak_gpu_gb']:.1f} |")
    if theirs:
        rows.append(f"| OpenCLIP 3.3 | accum {theirs.get('accum_freq', 1)} | {theirs['sub_batch']} | "
                    f"{theirs['step_s']:.3f} | {theirs['samples_per_s']:,.0f} | 1.00x | - | "
                    f"{theirs['peak_gpu_gb']:.1f} |")
    if entry.get("phases"):
        phases = ours[0]["steps"][-1]["phases_s"]
        rows.append("")
        rows.append("Where the step's time went: " + ", ".join(f"{k} {v:.1f} s" for k, v in phases.items()) + ".")
    return rows


def multi_gpu_table(data: dict, entry: dict) -> list[str]:
    if entry.get("memory"):
        return memory_table(data["results"])
    if entry.get("with_memory"):  # speed, then each run's memory
        return multi_gpu_table(data, {k: v for k, v in entry.items() if k != "with_memory"}) + [
            ""] + memory_table(data["results"])
    rows = ["| trainer | GPUs | samples/s (median) | slowest - fastest | slowest / median | s / step | "
            "x 1 GPU | vs OpenCLIP | MFU | peak GB |", "|---|---|---|---|---|---|---|---|---|---|"]
    runs = data["results"]
    results = [row for row in runs if row.get("samples_per_s")]
    for row in results:
        speed = row["samples_per_s"]
        one = next((r for r in results if r["system"] == row["system"] and r["gpus"] == 1), None)
        theirs = next((r for r in results if r["system"] == "openclip" and r["gpus"] == row["gpus"]), None)
        scaling = f"{speed['median'] / one['samples_per_s']['median']:.2f}x" if one and row["gpus"] > 1 else "-"
        versus = f"**{speed['median'] / theirs['samples_per_s']['median']:.2f}x**" \
            if theirs and row["system"] == "megabatch" else "-"
        trainer = trainer_name(row)
        peak = max(row["gpu_memory_peak_gb"]) if row.get("gpu_memory_peak_gb") else None
        mfu = row.get("mfu", {}).get("median")
        rows.append(f"| {trainer} | {row['gpus']} | {speed['median']:,.0f} | {speed['min']:,.0f} - {speed['max']:,.0f} "
                    f"| {speed['slowest_over_median']:.2f} | {sample_batch(row) / speed['median']:.2f} | {scaling} | "
                    f"{versus} | {f'{mfu * 100:.1f}%' if mfu else '-'} | {f'{peak:.1f}' if peak else '-'} |")
    if entry.get("waits"):
        rows += ["", "| trainer | data phase per step (s) | of which waiting for the GPU decoding (s) |",
                 "|---|---|---|"]
        for row in results:
            data = " ".join(f"{s['phases_s'].get('data', 0):.2f}" for s in row["steps"])
            decode = " ".join(f"{decoding_wait(s):.2f}" for s in row["steps"])
            rows.append(f"| megabatch ({row.get('variant') or 'default'}, {row['gpus']} GPU) | {data} | {decode} |")
        rows += ["", entry["waits"]]
    if entry.get("phases"):
        ours = next(row for row in results if row["system"] == "megabatch")
        last = ours["steps"][-1]["phases_s"]
        rows += ["", "Where the last step's time went (rank 0): " + ", ".join(f"{k} {v:.1f} s" for k, v in last.items())
                 + "."]
    if entry.get("every_step"):  # each step's seconds and phases, the first (compiling, tuning) included
        rows += ["", "| trainer | step | s | " + " | ".join(PHASES) + " | rank 0 allocated GB |",
                 "|---|---|---|" + "---|" * len(PHASES) + "---|"]
        for row in results:
            for step in row["steps"]:
                rows.append(f"| megabatch ({row.get('variant') or 'default'}, {row['gpus']} GPU) | {step['step']} | "
                            f"{sample_batch(row) / step['samples_per_s']:.1f} | "
                            + " | ".join(f"{step['phases_s'].get(p, 0):.1f}" for p in PHASES)
                            + f" | {step['peak_gpu_gb']:.1f} |")
    stopped = [row for row in runs if not row.get("samples_per_s")]
    if stopped:  # runs without a logged step: out of memory, a time limit, an error
        rows += ["", "| trainer | GPUs | batch | outcome | peak GB in use (nvidia-smi) |", "|---|---|---|---|---|"]
        for row in stopped:
            trainer = trainer_name(row)
            peak = max(row["gpu_memory_peak_gb"]) if row.get("gpu_memory_peak_gb") else None
            rows.append(f"| {trainer} | {row['gpus']} | {sample_batch(row):,} | {outcome(row)} | "
                        f"{f'{peak:.1f}' if peak else '-'} |")
    return rows


PHASES = ("data", "encode", "loss", "replay", "optimizer")


def trainer_name(row: dict) -> str:
    return ("megabatch" + (f" ({row['variant']})" if row.get("variant") else "")
            if row["system"] == "megabatch" else "OpenCLIP 3.3")


def memory_table(runs: list[dict]) -> list[str]:
    """Each run's batch, outcome and peak memory, for runs that measure memory and not speed."""
    rows = ["| trainer | GPUs | batch | outcome | rank 0 allocated GB | peak GB in use (nvidia-smi) |",
            "|---|---|---|---|---|---|"]
    for row in runs:
        trainer = trainer_name(row)
        allocated = max((s["peak_gpu_gb"] for s in row["steps"] if s.get("peak_gpu_gb")), default=None)
        peak = max(row["gpu_memory_peak_gb"]) if row.get("gpu_memory_peak_gb") else None
        done = f"{len(row['steps'])} step{'s' if len(row['steps']) > 1 else ''}" if row["steps"] else outcome(row)
        rows.append(f"| {trainer} | {row['gpus']} | {sample_batch(row):,} | {done} | "
                    f"{f'{allocated:.1f}' if allocated else '-'} | {f'{peak:.1f}' if peak else '-'} |")
    return rows


def outcome(row: dict) -> str:
    """Why a run logged no step."""
    text = row.get("log_tail", "") + " ".join(row.get("error_lines", []))
    if "OutOfMemoryError" in text or "out of memory" in text:
        return "out of memory"
    if row.get("returncode") == "timeout":
        return f"no step within its {row['wall_s']:.0f} s"
    return f"exit status {row.get('returncode')}"


def decoding_wait(step: dict) -> float:
    """A step's wait on the GPU decoding's look-ahead (its source and its decoding; ``_first`` is a part of them)."""
    return sum(v for k, v in step.get("decode_waits_s", {}).items() if k.endswith(("_source", "_decode")))


def sample_batch(row: dict) -> int:
    """A row's global batch in samples (``32k``, ``1M`` or a number)."""
    batch = str(row["batch"])
    for suffix, size in (("k", 2**10), ("M", 2**20)):
        if batch.endswith(suffix):
            return int(batch[:-1]) * size
    return int(batch)


def loader_table(data: dict, entry: dict) -> list[str]:
    if any("stored_teacher_width" in row for row in data["results"]):
        return teacher_loader_table(data["results"])
    rows = ["| split | index cache | workers | sub-batch | samples/s |", "|---|---|---|---|---|"]
    for row in data["results"]:
        rows.append(f"| `{row['split']}` | {row.get('index_cache') or '-'} | {row['workers']} | {row['sub_batch']} | "
                    f"{row['first_pass_samples_s']:,.0f} |")
    return rows


def teacher_loader_table(results: list[dict]) -> list[str]:
    """The loader's workers on plain shards and on shards carrying teacher embeddings, per way of reading them."""
    rows = ["| embeddings read by | shards | workers | samples/s | per worker | stored / plain |",
            "|---|---|---|---|---|---|"]
    for row in results:
        plain = next((r for r in results if r.get("teacher_read") == row.get("teacher_read")
                      and r["workers"] == row["workers"] and not r.get("stored_teacher_width")), None)
        ratio = f"{row['first_pass_samples_s'] / plain['first_pass_samples_s']:.2f}" \
            if plain and row.get("stored_teacher_width") else "-"
        shards = f"embeddings, width {row['stored_teacher_width']}" if row.get("stored_teacher_width") else "plain"
        rows.append(f"| {row.get('teacher_read', '-')} | {shards} | {row['workers']} | "
                    f"{row['first_pass_samples_s']:,.0f} | {row['first_pass_per_worker']:,.0f} | {ratio} |")
    return rows


def stop_table(data: dict, entry: dict) -> list[str]:
    row = data["results"][0] if isinstance(data["results"], list) else data["results"]
    return ["| launcher | signal to | signal at step | signal to exit | exit status | last.pt step | last.pt GB |",
            "|---|---|---|---|---|---|---|",
            f"| {row['launcher']} | {row['signal_to']} | {row['signal_at_step']} | {row['signal_to_exit_s']:.1f} s | "
            f"{row['exit_status']} | {row['last_pt_step']} | {row['last_pt_gb']:.2f} |"]


def attention_table(data: dict, entry: dict) -> list[str]:
    rows = ["| shape | kernel | forward ms | backward ms | forward / backward TFLOP/s | host us |",
            "|---|---|---|---|---|---|"]
    for row in data["results"]:
        if "forward_ms" in row:
            rows.append(f"| {row['shape']} | {row['kernel']} | {row['forward_ms']:.3f} | {row['backward_ms']:.3f} | "
                        f"{row['forward_tflops']:.0f} / {row['backward_tflops']:.0f} | "
                        f"{row.get('forward_backward_host_us', float('nan')):.0f} |")
    return rows


def mlp_table(data: dict, entry: dict) -> list[str]:
    chosen = next(row["tiles"] for row in data["results"] if row.get("impl") == "fused" and row.get("tiles"))
    rows = ["| shape | kernel | ms | TFLOP/s (of the GEMM) |", "|---|---|---|---|"]
    for row in data["results"]:
        if "ms" in row and row.get("tiles", chosen) == chosen:
            tiles = f" {tuple(row['tiles'])}" if row.get("tiles") else ""
            rows.append(f"| {row['shape']} | {row['impl']}{tiles} | {row['ms']:.3f} | {row['tflops']:.0f} |")
    rows += ["", "| shape | MLP | forward ms | backward ms |", "|---|---|---|---|"]
    for row in data["results"]:
        if "forward_ms" in row:
            rows.append(f"| {row['shape']} | {row['impl']} | {row['forward_ms']:.3f} | {row['backward_ms']:.3f} |")
    return rows


def layernorm_table(data: dict, entry: dict) -> list[str]:
    rows = ["| shape | implementation | forward ms | forward GB/s | backward ms | backward GB/s |",
            "|---|---|---|---|---|---|"]
    for row in data["results"]:
        if "forward_ms" in row:
            tiles = f" {tuple(row['tiles'])}" if row.get("tiles") else ""
            rows.append(f"| {row['shape']} | {row['impl']}{tiles} | {row['forward_ms']:.3f} | "
                        f"{row['forward_gb_per_s']:.0f} | {row['backward_ms']:.3f} | {row['backward_gb_per_s']:.0f} |")
        elif row.get("impl") == "copy":
            rows.append(f"| {row['shape']} | one clone of the same bytes | {row['ms']:.3f} | "
                        f"{row['gb_per_s']:.0f} | | |")
    return rows


def towers_table(data: dict, entry: dict) -> list[str]:
    parts = ("image_forward_s", "image_replay_s", "text_forward_s", "text_replay_s")
    rows = ["| variant | image forward ms | image replay ms | text forward ms | text replay ms |",
            "|---|---|---|---|---|"]
    for row in data["results"]:
        if all(part in row for part in parts):
            rows.append(f"| {row['variant']} | " + " | ".join(f"{row[part] * 1e3:.1f}" for part in parts) + " |")
    return rows


def learning_table(data: dict, entry: dict) -> list[str]:
    steps = (100, 200, 300, 400, 500)
    rows = ["| setting | seeds | " + " | ".join(f"loss at {step}" for step in steps)
            + " | loss, last 100 steps | zero-shot top-1: mean (each) |", "|---" * (len(steps) + 4) + "|"]
    for summary in data["meta"]["summary"]:
        runs = [row for row in data["results"] if row["setting"] == summary["setting"]]
        curve = [sum(row["loss"][str(step)] for row in runs) / len(runs) for step in steps]
        each = ", ".join(f"{top1:.2f}" for top1 in summary["zero_shot_top1_each"])
        rows.append(f"| `{summary['setting']}` | {summary['seeds']} | " + " | ".join(f"{v:.3f}" for v in curve)
                    + f" | {summary['loss_last_100_mean']:.3f} | {summary['zero_shot_top1_mean']:.2f}% ({each}) |")
        if "caption_accuracy_mean" in summary:  # learning.py --caption-accuracy (a CoCa)
            named = ", ".join(f"{value:.2f}" for value in summary["caption_accuracy_each"])
            rows[-1] += f" {summary['caption_accuracy_mean']:.2f}% ({named}) |"
    if any("caption_accuracy_mean" in summary for summary in data["meta"]["summary"]):
        rows[0] += " held-out captions naming the digit: mean (each) |"
        rows[1] += "---|"
    return rows


def eval_suite_table(data: dict, entry: dict) -> list[str]:
    """scripts/benchmarks/eval_suite.py: each run's wall time and each set's seconds and main number; the
    agreement of the several-GPU run with the one-GPU run."""
    from megabatch.report.results import headline, main_metric

    runs = [r for r in data["results"] if r.get("run") != "agreement"]
    names = list(dict.fromkeys(name for r in runs for name in r.get("sets", {})))
    first = {n: next(r["sets"][n] for r in runs if n in r.get("sets", {})) for n in names}
    rows = ["| run | GPUs | wall s | " + " | ".join(f"{n}: s, {main_metric(first[n])}" for n in names) + " |",
            "|---|---|---|" + "---|" * len(names)]
    for r in runs:
        cells = [f"{r['sets'][n]['seconds']:.1f} s, {headline(r['sets'][n]):.2f}" if n in r.get("sets", {}) else
                 ("-" if r.get("returncode") == 0 else f"({r.get('returncode')})") for n in names]
        wall = f"{r['wall_s']:.1f}" if r.get("returncode") == 0 else f"{r['wall_s']:.0f} ({r.get('returncode')})"
        rows.append(f"| {r['run']} | {r['gpus']} | {wall} | " + " | ".join(cells) + " |")
    for r in data["results"]:
        if r.get("run") == "agreement":
            worst = ", ".join(f"{n} {v:.2g}" for n, v in r["max_abs_difference"].items())
            rows += ["", f"Largest difference between the 1- and {r['gpus'][1]}-GPU numbers, per set: {worst}"]
    return rows


TABLES = {"eval_suite": eval_suite_table, "loss": loss_table, "e2e": e2e_table,
          "loader": loader_table, "stop": stop_table,
          "attention": attention_table, "mlp": mlp_table, "towers": towers_table, "learning": learning_table,
          "layernorm": layernorm_table, "multi_gpu": multi_gpu_table}


def page() -> str:
    lines = ["# Benchmarks", "",
             "[megabatch](../README.md) / Benchmarks. Today's figures, each with the machine, date, commit and "
             "command that measured it. This page is written by `python scripts/benchmarks/results_page.py` "
             "from the JSONs in [bench/](bench/); do not edit it by hand. How to run a benchmark: "
             "[scripts/benchmarks/README.md](../scripts/benchmarks/README.md). Superseded measurements "
             "are in git history (`git log --stat -- docs/bench`).", ""]
    contents = [f"- [{q['title'].replace('`', '')}](#{anchor(q['title'])})" for q in QUESTIONS]
    lines += ["Questions:", "", *contents, ""]
    for question in QUESTIONS:
        lines += [f"## {question['title']}", "", question["text"], ""]
        if question.get("picture"):
            lines += [f"![{question['title'].replace('`', '')}](bench/{question['picture']})", ""]
        for entry in question["entries"]:
            data = load(entry["file"])
            meta = data.get("meta") or {k: v for k, v in data.items() if k != "results"}
            if entry.get("label"):
                lines += [f"**{entry['label']}**", ""]
            lines += TABLES[entry["kind"]](data, entry) + ["", provenance(entry["file"], meta), ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def anchor(title: str) -> str:
    keep = "".join(ch for ch in title.lower() if ch.isalnum() or ch in " -_")
    return keep.replace(" ", "-")


def cited() -> set[str]:
    """The docs/bench files this page reads or shows."""
    names = {entry["file"] for question in QUESTIONS for entry in question["entries"]}
    return names | {question["picture"] for question in QUESTIONS if question.get("picture")}


def plot_end_to_end(out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, ratios = [], []
    for entry in QUESTIONS[1]["entries"]:
        ours, theirs = e2e_rows(load(entry["file"]))
        if theirs and ours:
            labels.append(entry["label"].split(" (")[0].replace(", batch", "\n"))
            ratios.append(max(row["steady_samples_s"] for row in ours) / theirs["samples_per_s"])
    fig, ax = plt.subplots(figsize=(8, 3.6))
    bars = ax.bar(range(len(ratios)), ratios, color="#3b7dd8")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(ratios)), labels, fontsize=8)
    ax.set_ylabel("samples/s, megabatch / OpenCLIP")
    ax.set_title("End to end against OpenCLIP 3.3 --torchcompile (one GPU)")
    for bar, ratio in zip(bars, ratios, strict=True):
        ax.text(bar.get_x() + bar.get_width() / 2, ratio + 0.02, f"{ratio:.2f}x", ha="center", fontsize=8)
    ax.set_ylim(0, max(ratios) * 1.2)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


FORKSERVER_RUN = "multi_gpu_vit_b32_32k_forkserver_thread_4xh200.json"
BATCH_256K = {"ViT-B/32": ("multi_gpu_vit_b32_256k_1gpu_4xh200.json", "multi_gpu_vit_b32_256k_2gpu_4xh200.json",
                           "multi_gpu_vit_b32_256k_4xh200.json"),
              "ViT-B/16": ("multi_gpu_vit_b16_256k_1gpu_2xh200.json", "multi_gpu_vit_b16_256k_2gpu_2xh200.json",
                           "multi_gpu_vit_b16_256k_4xh200.json")}


def warmup_steps(data: dict) -> int:
    """The steps a multi_gpu.py run left out of its figures (``--warmup-steps``, 2 unless its command says)."""
    words = data["meta"]["command"].split()
    return int(words[words.index("--warmup-steps") + 1]) if "--warmup-steps" in words else 2


def plot_multi_gpu(out: Path) -> None:
    """Samples/s against GPUs at 32k (ViT-B/32 beside OpenCLIP, ViT-B/16) and 256k, each step after warm-up a
    dot, the median a line, linear scaling from one GPU at 32k dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, (file, arch) in zip(axes, (("multi_gpu_vit_b32_32k_4xh200.json", "ViT-B/32"),
                                       ("multi_gpu_vit_b16_32k_4xh200.json", "ViT-B/16")), strict=True):
        data = load(file)
        for system, color, label in (("megabatch", "#3b7dd8", "megabatch (torchrun train.py)"),
                                     ("openclip", "#d8703b", "OpenCLIP 3.3 (torchrun)")):
            rows = sorted((r for r in data["results"] if r["system"] == system and r.get("steps")),
                          key=lambda r: r["gpus"])
            if not rows:
                continue
            for row in rows:
                speeds = [s["samples_per_s"] / 1e3 for s in row["steps"][2:]]
                ax.scatter([row["gpus"]] * len(speeds), speeds, color=color, alpha=0.35, s=14)
            ax.plot([r["gpus"] for r in rows], [r["samples_per_s"]["median"] / 1e3 for r in rows], "o-",
                    color=color, label=label)
        if arch == "ViT-B/32":  # a later machine: the loader's workers from a fork server
            rows = sorted((r for r in load(FORKSERVER_RUN)["results"] if r.get("steps")), key=lambda r: r["gpus"])
            for row in rows:
                speeds = [s["samples_per_s"] / 1e3 for s in row["steps"][2:]]
                ax.scatter([row["gpus"]] * len(speeds), speeds, color="#3ba65a", alpha=0.35, s=14)
            ax.plot([r["gpus"] for r in rows], [r["samples_per_s"]["median"] / 1e3 for r in rows], "s-",
                    color="#3ba65a", label="megabatch as released (fork server; another machine)")
        # 256k: a run per GPU count, each on a machine of its own
        points = sorted((row["gpus"], warmup_steps(load(file)), row) for file in BATCH_256K[arch]
                        for row in load(file)["results"] if row.get("steps"))
        for gpus, warmup, row in points:
            speeds = [s["samples_per_s"] / 1e3 for s in row["steps"][warmup:]]
            ax.scatter([gpus] * len(speeds), speeds, color="#8a4fc4", alpha=0.35, s=14)
        ax.plot([g for g, _, _ in points], [r["samples_per_s"]["median"] / 1e3 for _, _, r in points], "D-",
                color="#8a4fc4", label="megabatch at 256k (points from several machines)")
        ours = [r for r in data["results"] if r["system"] == "megabatch" and r["gpus"] == 1]
        if ours:
            base = ours[0]["samples_per_s"]["median"] / 1e3
            ax.plot([1, 4], [base, 4 * base], ":", color="gray", label="linear from 1 GPU")
        ax.set_xticks([1, 2, 4])
        ax.set_xlabel("H200 GPUs of one host")
        ax.set_ylabel("k samples/s (dots: steps; line: median)")
        ax.set_title(f"{arch}, loss=infcl (batch 32k unless named)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/benchmarks.md is out of date")
    parser.add_argument("--plots", action="store_true", help="also draw the pictures (matplotlib)")
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    text = page()
    if args.check:
        if not PAGE.exists() or PAGE.read_text() != text:
            print(f"{PAGE.relative_to(ROOT)} is out of date: run python scripts/benchmarks/results_page.py")
            return 1
        return 0
    PAGE.write_text(text)
    if args.plots:
        plot_end_to_end(BENCH / E2E_PLOT)
        plot_multi_gpu(BENCH / MULTI_GPU_PLOT)
    print(f"wrote {PAGE.relative_to(ROOT)}" + (f" and {E2E_PLOT}, {MULTI_GPU_PLOT}" if args.plots else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
