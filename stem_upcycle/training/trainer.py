"""`stem-upcycle train`: recovery training of a STEM model against its dense teacher.

One loop serves one CPU, one GPU and many processes (`accelerate launch`). Each optimizer step
reads `batch_size` packed sequences, split over processes and micro-batches; the student's final
hidden states go through the chunked KD + CE head loss; dense parts train with AdamW (DDP / FSDP
through accelerate), tables with a row-wise optimizer on the step's rows only (their gradients
are averaged across processes by hand: every process gathers the same rows, those of the global
batch; the tables are one shared host copy per machine, see tables.SharedTables). Output layout:

    OUTPUT/init/             the converted starting point (removed after export unless model.keep_init)
    OUTPUT/host-tables/      node-N/: each machine's shared copy of the tables and their optimizer state while training
    OUTPUT/checkpoints/      step-N/ with the model and dense optimizer (accelerate), tables and their
                             optimizer state (removed after export unless train.keep_checkpoints_at_end)
    OUTPUT/recipe.yaml       the recipe as run;  OUTPUT/train_log.jsonl  one JSON object per line
    OUTPUT/*.safetensors ... the trained STEM model, written at the end
"""

import hashlib
import json
import math
import os
import resource
import shutil
import sys
import time
from contextlib import nullcontext, suppress
from pathlib import Path

import torch
from torch import nn

from ..table_init.calibrated import skipped_positions
from ..errors import UserError
from ..evaluate import figures
from ..loading import load_tokenizer, model_from_source
from ..source import open_source
from . import checkpoint, export
from .data import MixedBatches, fetch_datasets, load_data, pack_ids, resolve_datasets, text_needs
from .starting_point import generated_text, initial_model
from .losses import HeadLoss, head_loss
from .recipe import Recipe, bf16_autocast, check_batch
from .student import attach_tables, base_model, select_trainable, set_blend, set_handoff, unwrap_lora
from .tables import TABLE_OPTIMIZERS, SharedTables, clip_rows, distinct_ids


class TrainError(UserError):
    pass


class DistillStep(nn.Module):
    """Student forward + chunked head loss as one module, so that DDP / FSDP can wrap it."""

    def __init__(self, student, spec: HeadLoss):
        super().__init__()
        self.student, self.spec = student, spec

    def forward(self, inputs, targets, teacher_hidden, teacher_weight, normalizer: float, ce_mask=None):
        hidden = base_model(self.student)(input_ids=inputs, use_cache=False).last_hidden_state  # [b, s, d]
        head = self.student.get_output_embeddings().weight  # [vocab, d]
        return head_loss(self.spec, hidden.flatten(0, 1), head, targets.flatten(),
                         None if teacher_hidden is None else teacher_hidden.flatten(0, 1), teacher_weight, normalizer,
                         None if ce_mask is None else ce_mask.flatten())


def lr_at(step: int, peak: float, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup to `peak`, then cosine decay to `min_ratio * peak` at the last step.

    Not transformers' get_cosine_with_min_lr_schedule_with_warmup: that drives torch optimizers
    (the table optimizers are not), and its warmup spends the first step at LR 0."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


class Trainer:
    def __init__(self, recipe: Recipe, output: Path, resume: bool = False, progress: bool = True,
                 token: str | None = None):
        from accelerate import Accelerator, DistributedType
        from accelerate.utils import parse_flag_from_env

        self.recipe, self.output, self.progress = recipe, Path(output), progress
        self.hub = recipe.model.hub(token, progress)  # how model.source is fetched when it is a hub id
        # names this run's temporaries in folders other runs share (token caches, tables.host_dir): the same in
        # every process and in a resumed run, different for a run into another OUTPUT
        self.run_key = hashlib.sha1(str(self.output.absolute()).encode()).hexdigest()[:12]
        t = recipe.train
        if recipe.handoff.steps >= t.steps:
            raise TrainError(f"handoff.steps ({recipe.handoff.steps}) must be below train.steps ({t.steps}): "
                             f"the hand-off has to finish before the model is exported")
        bf16 = bf16_autocast(t, torch.cuda.is_available() and torch.cuda.is_bf16_supported())
        self.accelerator = Accelerator(mixed_precision="bf16" if bf16 else "no")
        acc = self.accelerator
        self.world = acc.num_processes
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        if launched > 1 and self.world == 1:  # e.g. torchrun on a machine without GPUs, ACCELERATE_USE_CPU unset
            raise TrainError(f"{launched} processes were launched but accelerate started no distributed training, so "
                             f"each would train alone into the same DIR; on a machine without GPUs set "
                             f"ACCELERATE_USE_CPU=1 (`accelerate launch --cpu` itself starts one process only)")
        check_batch(t, self.world)
        if parse_flag_from_env("ACCELERATE_USE_FSDP") and acc.distributed_type != DistributedType.FSDP:
            # accelerate runs FSDP on accelerators only: on CPU processes it silently wraps the model in DDP
            raise TrainError(f"FSDP was asked for (accelerate launch --use_fsdp or an FSDP config) but accelerate "
                             f"runs {acc.distributed_type.value} here, without sharding: it runs FSDP on GPUs only; on "
                             f"CPU processes launch with --multi_gpu (DDP) or recipes/accelerate/ddp.yaml")
        if acc.distributed_type == DistributedType.FSDP and "lora" in t.trainable:
            raise TrainError("under FSDP, train LoRA-free: merging sharded adapters is not supported yet")
        existed = self.output.exists()
        checkpoint.prepare_output(self.output, recipe, resume, acc.is_main_process, acc.wait_for_everyone)
        acc.wait_for_everyone()
        try:
            self._set_up(resume)
        except UserError:
            # A mistake found while setting up (a value the model refuses, too little text): a new run's OUTPUT
            # holds only what this run wrote, so it goes, and the corrected command can use the same --output.
            if getattr(self, "shared", None) is not None:
                self._remove_host_tables()
            if not resume and acc.is_main_process:
                shutil.rmtree(self.output, ignore_errors=True)
                if existed:
                    self.output.mkdir()
            raise

    # -- setup ---------------------------------------------------------------------------------
    def _set_up(self, resume: bool) -> None:
        recipe, t, acc = self.recipe, self.recipe.train, self.accelerator
        torch.manual_seed(t.seed)

        with acc.local_main_process_first():  # a hub id: one process downloads (each machine's first), the others read it
            self.source = open_source(recipe.model.source, self.hub)
        self.teacher = self._teacher()  # the distillation target, and the reference of every evaluation
        self.teacher_tokenizer = load_tokenizer(self.source)  # what generation samples with and calibration joins with
        self.datasets = self._datasets(resume)
        self.generated, self.generation_stats = generated_text(recipe, self.source, self.teacher,
                                                               self.teacher_tokenizer, acc, self.progress)
        self.init_dir, calibrated = initial_model(recipe, self.source, self.teacher, self.teacher_tokenizer,
                                                  self.generated, acc, self.output, self.progress, self.datasets)
        init = open_source(str(self.init_dir))
        # Which ids' rows were set from text (calibrated here) or trained so far: the held-out tokens they
        # cover are reported with every evaluation. A first token that keeps W_up reads no row.
        self.first_skipped = skipped_positions(init.config)
        self.covered = torch.zeros(init.config.vocab_size, dtype=torch.bool)
        if calibrated is not None:
            self.covered[calibrated] = True
        self.tokenizer = load_tokenizer(init)
        train_text, self.heldout = load_data(recipe, self.tokenizer, acc.process_index, acc.num_processes,
                                             acc.wait_for_everyone, run=self.run_key, datasets=self.datasets,
                                             progress=self.progress and acc.is_main_process)
        generated = None if self.generated is None else pack_ids(self.generated, self.tokenizer, recipe.data.seq_len)
        self.batches = MixedBatches(train_text, generated, t.batch_size, recipe.generated.train_share, t.seed,
                                    recipe.data.train_weights())
        self._eval_reference = {}  # held-out set -> (teacher hidden states per micro-batch, teacher nll), once

        from transformers import AutoModelForCausalLM

        is_stem = init.config.model_type == "stem"
        # The tables stay in the checkpoint's files until attach_tables copies them into the shared host copy.
        student = AutoModelForCausalLM.from_pretrained(self.init_dir, dtype=torch.float32,
                                                       **({"stem_tables": "mmap"} if is_stem else {}))
        if not is_stem and ("tables" in t.trainable or recipe.handoff.steps):
            # A dense init_from is allowed as a baseline: the dense model fine-tuned by the same recipe.
            raise TrainError(f"{self.init_dir} is not a STEM model, so it has no tables to train or hand off to; "
                             f"model.init_from must name a converted checkpoint")
        if student.config.vocab_size != self.teacher.config.vocab_size:
            raise TrainError(f"{recipe.model.source} has a vocabulary of {self.teacher.config.vocab_size}, the model "
                             f"to train one of {student.config.vocab_size}; the teacher must be its dense base")
        self.causal_lm = student
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", self.world))
        # One copy per machine, in a folder of its own (machines that share OUTPUT's file system, or run as two
        # nodes on one host, keep apart copies) and, in a host_dir that several runs share, of this run's own.
        host = (Path(recipe.tables.host_dir) / f"{self.output.name}-{self.run_key}" if recipe.tables.host_dir
                else self.output / "host-tables") / f"node-{acc.process_index // local_world}"
        self.shared = SharedTables(host, acc.local_process_index, local_world, acc.wait_for_everyone)
        self.tables = attach_tables(student, acc.device, self.shared)
        if recipe.handoff.steps:
            set_handoff(student, self.teacher)
        self.trainable = select_trainable(student, t.trainable, recipe.lora)
        if t.gradient_checkpointing:
            if hasattr(student, "activation_checkpointing_enable"):  # Transformers 5.24's name; the old one warns
                student.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:  # the declared range starts at 4.57, which has only the old name
                student.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        student.train()  # from_pretrained returns eval mode, in which Transformers never checkpoints
        spec = HeadLoss.for_config(student.config, ce_weight=recipe.loss.ce_weight, kd_weight=recipe.loss.kd_weight,
                                   temperature=recipe.loss.temperature, chunk_tokens=recipe.loss.chunk_tokens)
        self.step_module = DistillStep(student, spec)
        dense = [p for p in self.step_module.parameters() if p.requires_grad]
        self.dense_optimizer = torch.optim.AdamW(dense, lr=t.lr, weight_decay=t.weight_decay) if dense else None
        table_list = [self.tables[i] for i in sorted(self.tables)]
        self.table_optimizer = (TABLE_OPTIMIZERS[recipe.tables.optimizer](
            table_list, eps=recipe.tables.eps, weight_decay=recipe.tables.weight_decay,
            zeros=self.shared.zeros("optimizer"))
            if "tables" in t.trainable else None)
        if dense:
            self.step_module, self.dense_optimizer = acc.prepare(self.step_module, self.dense_optimizer)
        else:
            self.step_module.to(acc.device)
        self.start_step, self.tokens_seen = 0, 0
        if resume:
            self.start_step, self.tokens_seen = checkpoint.load_latest(acc, self.output / "checkpoints", self.tables,
                                                                       self.table_optimizer)
            for step in range(self.start_step):
                self._cover(self.batches.step(step)[0])
            if recipe.handoff.steps and self.start_step >= recipe.handoff.steps:
                set_handoff(student, None)  # the hand-off was over: W_up is dropped

    def _teacher(self):
        dtype = torch.bfloat16 if self.accelerator.mixed_precision == "bf16" else torch.float32
        return model_from_source(self.source, dtype).to(self.accelerator.device).requires_grad_(False)

    def _datasets(self, resume: bool) -> dict:
        """The recipe's `hf:` datasets: which files, resolved once by the main process (a resumed run: those its start
        chose, OUTPUT/datasets.json, whatever its branch names now) and sent to every process, so that machines
        agree; then downloaded by each machine's first process, the others reading its cache afterwards."""
        from accelerate.utils import broadcast_object_list

        acc, record = self.accelerator, self.output / export.DATASETS_FILE
        pinned = [None]
        if acc.is_main_process and text_needs(self.recipe):
            if resume and record.exists():
                pinned[0] = json.loads(record.read_text())
            else:
                resolved = resolve_datasets(self.recipe, self.teacher_tokenizer, self.hub.token)
                pinned[0] = {entry: r.record() for entry, r in resolved.items()}
                record.write_text(json.dumps(pinned[0], indent=1) + "\n")
        if self.world > 1:
            broadcast_object_list(pinned)  # a main process's error has ended the run before this
        if pinned[0] is None:
            return {}
        with acc.local_main_process_first():
            return fetch_datasets(self.recipe, self.teacher_tokenizer, self.hub.token,
                                  self.progress and acc.is_local_main_process, pinned[0])

    # -- one step ------------------------------------------------------------------------------
    def _teacher_hidden(self, inputs):
        with torch.no_grad(), self.accelerator.autocast():
            return base_model(self.teacher)(input_ids=inputs, use_cache=False).last_hidden_state

    @property
    def teacher_weight(self):
        return self.teacher.get_output_embeddings().weight

    def _blend(self, step: int) -> float:
        n = self.recipe.handoff.steps
        return 1.0 if not n else min(1.0, step / n)

    def train_step(self, step: int) -> dict:
        t, acc = self.recipe.train, self.accelerator
        batch, generated = self.batches.step(step)  # [batch_size, seq_len + 1], the global batch; [batch_size]
        self._cover(batch)
        every_row = getattr(self.table_optimizer, "all_rows", False)  # dense AdamW updates whole tables
        # the rows of the whole global batch, on every process
        rows = None if every_row else distinct_ids(batch[:, :-1])
        for table in self.tables.values():
            table.gather(torch.arange(table.weight.shape[0]) if every_row else rows)
        batch = batch.to(acc.device)
        ce_rows = (~generated | self.recipe.generated.ce).to(acc.device)  # sequences with a cross-entropy term
        set_blend(self.causal_lm, self._blend(step))
        mine = batch.chunk(self.world)[acc.process_index]
        mine_ce = ce_rows.chunk(self.world)[acc.process_index]
        micro = list(zip(mine.split(t.micro_batch_size), mine_ce.split(t.micro_batch_size)))
        normalizer = mine[:, 1:].numel()
        sums = torch.zeros(5, dtype=torch.float64, device=acc.device)
        loss_total = 0.0
        # Accumulation by hand, not accelerate's accumulate(): that divides each micro-batch's loss by
        # their count, where ours are normalised by the step's tokens (and carry unequal CE tokens).
        for i, (chunk, chunk_ce) in enumerate(micro):
            inputs, targets = chunk[:, :-1], chunk[:, 1:]
            ce_mask = chunk_ce[:, None].expand_as(targets)
            teacher_hidden = self._teacher_hidden(inputs)
            sync = i == len(micro) - 1 or self.dense_optimizer is None
            context = acc.no_sync(self.step_module) if not sync else nullcontext()
            with context, acc.autocast():
                loss, part = self.step_module(inputs, targets, teacher_hidden, self.teacher_weight, normalizer, ce_mask)
                if loss.requires_grad:
                    acc.backward(loss)
            sums += part
            loss_total += loss.item()
        record = {"step": step + 1}
        if self.table_optimizer is not None:
            self._reduce_row_grads()
            record["table_grad_norm"] = clip_rows(list(self.tables.values()), self.recipe.tables.max_grad_norm)
            record["table_lr"] = lr_at(step, self.recipe.tables.lr, self.recipe.tables.warmup_steps, t.steps, t.min_lr_ratio)
            self.table_optimizer.step(record["table_lr"])  # each process writes its own rows
            if self.world > 1:
                acc.wait_for_everyone()  # every row written before any process gathers the next step's
        if self.dense_optimizer is not None:
            if t.max_grad_norm:
                record["grad_norm"] = float(acc.clip_grad_norm_(self.step_module.parameters(), t.max_grad_norm))
            record["lr"] = lr_at(step, t.lr, t.warmup_steps, t.steps, t.min_lr_ratio)
            for group in self.dense_optimizer.param_groups:
                group["lr"] = record["lr"]
            self.dense_optimizer.step()
            self.dense_optimizer.zero_grad(set_to_none=True)
        if self.recipe.handoff.steps and step + 1 == self.recipe.handoff.steps:
            set_handoff(self.causal_lm, None)  # the hand-off is over: W_up is dropped
        sums = acc.reduce(sums, reduction="sum") if self.world > 1 else sums
        self.tokens_seen += batch[:, 1:].numel()
        record.update(loss=acc.reduce(torch.tensor(loss_total, device=acc.device), reduction="mean").item(),
                      ce=(sums[0] / sums[4]).item() if sums[4] else None, kd=(sums[1] / sums[3]).item(),
                      blend=self._blend(step),
                      tokens=self.tokens_seen)
        return record

    def _cover(self, batch: torch.Tensor) -> None:
        """Mark the ids whose rows `batch` [n, seq_len + 1] trains."""
        self.covered[batch[:, self.first_skipped : -1].flatten().cpu()] = True

    def _reduce_row_grads(self) -> None:
        for table in self.tables.values():
            if table.rows.grad is None:
                table.rows.grad = torch.zeros_like(table.rows)
            if self.world > 1:
                torch.distributed.all_reduce(table.rows.grad)
                table.rows.grad /= self.world

    # -- evaluation ----------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict:
        """{"eval": {set: {ppl, ref_ppl, ppl_ratio, kl, top1_agreement, tokens, rows_covered}}} on every held-out set
        (rows_covered: the share of the set's tokens whose rows this run calibrated or has trained),
        in eval mode (no dropout), training mode restored after; and "host_memory_gb", summed over the
        processes: PSS, and the size, PSS and RSS of the shared tables' and optimizer states' files."""
        self.causal_lm.eval()
        try:
            results = {"eval": {name: self._evaluate_set(name, sequences) for name, sequences in self.heldout.items()}}
        finally:
            self.causal_lm.train()
        memory = torch.tensor(self.shared.memory(), dtype=torch.float64, device=self.accelerator.device)
        memory = self.accelerator.reduce(memory, reduction="sum") if self.world > 1 else memory
        files = sum(f.stat().st_size for f in self.shared.folder.iterdir()) / 2**30
        results["host_memory_gb"] = {"processes": self.world, "pss": memory[0].item(), "shared_files": files,
                                     "shared_pss": memory[1].item(), "shared_rss": memory[2].item()}
        return results

    def _evaluate_set(self, name: str, sequences: torch.Tensor) -> dict:
        acc, t = self.accelerator, self.recipe.train
        spec = acc.unwrap_model(self.step_module).spec
        on_host = sequences.split(t.micro_batch_size)
        chunks = sequences.to(acc.device).split(t.micro_batch_size)
        if name not in self._eval_reference:  # the teacher's side never changes: computed once per set
            hidden = [self._teacher_hidden(chunk[:, :-1]) for chunk in chunks]
            ref_nll = 0.0
            for chunk, th in zip(chunks, hidden):
                th = th.flatten(0, 1)
                with acc.autocast():
                    ref_nll += head_loss(spec, th, self.teacher_weight, chunk[:, 1:].flatten(), th,
                                         self.teacher_weight)[1][0].item()
            self._eval_reference[name] = [h.cpu() for h in hidden], ref_nll
        hidden, ref_nll = self._eval_reference[name]
        sums = torch.zeros(5, dtype=torch.float64, device=acc.device)
        for host_chunk, chunk, teacher_hidden in zip(on_host, chunks, hidden):
            inputs, targets = chunk[:, :-1], chunk[:, 1:]
            rows = distinct_ids(host_chunk[:, :-1])
            for table in self.tables.values():
                table.gather(rows)
            with acc.autocast():
                sums += self.step_module(inputs, targets, teacher_hidden.to(acc.device), self.teacher_weight, 1.0)[1]
        n = sums[3].item()
        read = sequences[:, self.first_skipped : -1].cpu()  # the ids whose rows the set's forwards read
        return {**figures(sums[0].item(), int(n), ref_nll, sums[1].item(), sums[2].item()),
                "rows_covered": self.covered[read].float().mean().item()}

    # -- the loop ------------------------------------------------------------------------------
    def run(self) -> Path:
        from tqdm.auto import tqdm

        t, acc = self.recipe.train, self.accelerator
        log = checkpoint.Log(self.output / "train_log.jsonl", acc.is_main_process, self.start_step)
        if self.start_step == 0:
            log.write({"step": 0, "tokens": 0, **({"generated": self.generation_stats} if self.generation_stats else {}),
                       **self.evaluate()})
        bar = tqdm(total=t.steps, initial=self.start_step, desc="train", unit="step",
                   disable=not (self.progress and acc.is_main_process), file=sys.stderr)
        started, tokens_at_start = time.perf_counter(), self.tokens_seen
        for step in range(self.start_step, t.steps):
            record = self.train_step(step)
            elapsed = time.perf_counter() - started
            record["tokens_per_s"] = (self.tokens_seen - tokens_at_start) / elapsed
            record["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # kB -> GiB (Linux)
            done = step + 1
            if (t.eval_every and done % t.eval_every == 0) or done == t.steps:
                record.update(self.evaluate())
            if t.log_every and (done % t.log_every == 0 or "eval" in record):
                log.write(record)
            bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}",
                            **{name: f"{e['ppl_ratio']:.2f}x" for name, e in record.get("eval", {}).items()})
            bar.update()
            if t.checkpoint_every and done % t.checkpoint_every == 0 and done < t.steps:
                checkpoint.save(acc, self.output / "checkpoints", done, self.tables, self.table_optimizer,
                                self.tokens_seen, t.keep_checkpoints)
        bar.close()
        return self.export()

    def export(self) -> Path:
        acc = self.accelerator
        acc.wait_for_everyone()
        if "lora" in self.recipe.train.trainable:  # adapters merged into their base weights
            state = unwrap_lora(self.trainable).state_dict()
        else:  # every process takes part: under FSDP this gathers the full weights on the main one
            state = {k.removeprefix("student."): v for k, v in acc.get_state_dict(self.step_module).items()}
        if acc.is_main_process:
            export.write_model(self.output, self.init_dir, self.source, self.recipe,
                               {i: t.weight for i, t in self.tables.items()}, state, self.tokens_seen, self.datasets)
            if not (self.recipe.model.init_from or self.recipe.model.keep_init):
                shutil.rmtree(self.init_dir, ignore_errors=True)
            if not self.recipe.train.keep_checkpoints_at_end:  # OUTPUT is then the model, ready to share
                shutil.rmtree(self.output / "checkpoints", ignore_errors=True)
        acc.wait_for_everyone()
        self._remove_host_tables()
        return self.output

    def _remove_host_tables(self) -> None:
        """This machine's copy of the tables (by its local main process); never the user's host_dir itself."""
        if self.accelerator.is_local_main_process:
            shutil.rmtree(self.shared.folder, ignore_errors=True)
            with suppress(OSError):  # still holding another machine's copy: its own process removes it
                self.shared.folder.parent.rmdir()


def train(recipe: Recipe, output: str | Path, resume: bool = False, progress: bool = True,
          token: str | None = None) -> Path:
    """`token`: for a model.source given by hub id (None: HF_TOKEN or the stored login)."""
    return Trainer(recipe, Path(output), resume=resume, progress=progress, token=token).run()
