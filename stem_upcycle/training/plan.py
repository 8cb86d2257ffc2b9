"""`stem-upcycle train RECIPE --plan`: what every process and every machine of a run will hold, from the
recipe and the tensors' shapes alone (no weight is read), checked against this machine.

A run's memory, by where it lives (see trainer.py, tables.py):

- each process, on its device: the teacher whole (never sharded: it is not prepared by accelerate), the
  student's dense weights in fp32, their gradients and AdamW's two moments for the trainable ones (all
  three divided among the processes under FSDP, plus one decoder layer gathered whole at a time), the
  rows of one step's distinct ids with their gradients (those of the whole global batch, on every process),
  and the activations of one micro-batch;
- each machine, in host memory: one copy of the tables in fp32 and their optimizer state, files mapped by
  all its processes (`SharedTables`); while loading, each process reads the teacher and the student on the
  host before moving them to its device;
- OUTPUT's disk: the converted starting point (fp32), the checkpoints kept, the tables' host copy (unless
  tables.host_dir puts it elsewhere) and the exported model.

The activations are an estimate (saved layer inputs, one layer's working set, the head loss's chunk); every
other figure is a count of elements times their width.
"""

import dataclasses
import math
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

from ..errors import UserError
from ..modeling.configuration_stem import table_columns
from ..modeling.table_files import is_table_tensor
from ..table_init.protocol import FitOptions
from .recipe import Recipe, bf16_autocast, check_batch
from .student import is_trainable

GB = 10**9
LOSS_CHUNK_BYTES = 64 * 2**20  # losses.py: logits of at most 64 MiB per chunk
RUNTIME_BYTES = {"cpu": 6 * 10**8, "cuda": 2 * GB}  # a process's own: Python, torch, transformers (a CUDA context)


class PlanError(UserError):
    pass


@dataclass(frozen=True)
class Launch:
    """How the run will be launched: processes per machine, machines, FSDP or not, on which device."""

    processes: int = 1
    machines: int = 1
    fsdp: bool = False
    device: str = "cpu"  # "cuda" or "cpu"

    @property
    def world(self) -> int:
        return self.processes * self.machines

    @classmethod
    def from_accelerate_config(cls, path: str | None) -> "Launch":
        """From an accelerate config file (`accelerate launch --config_file`); None: one process, on a GPU if
        this machine has one."""
        here = "cuda" if torch.cuda.is_available() else "cpu"
        if path is None:
            return cls(device=here)
        try:
            config = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as err:
            raise PlanError(f"--launch-config {path}: cannot read it as an accelerate config ({err})") from None
        machines = int(config.get("num_machines", 1))
        total = int(config.get("num_processes", 1))  # accelerate counts the processes of every machine
        if total % machines:
            raise PlanError(f"--launch-config {path}: num_processes {total} is not a multiple of num_machines {machines}")
        kind = str(config.get("distributed_type", "NO")).upper()
        device = "cpu" if config.get("use_cpu") or kind == "MULTI_CPU" else "cuda"
        return cls(total // machines, machines, kind == "FSDP", device)


@dataclass
class Line:
    what: str
    bytes: int
    note: str = ""


@dataclass
class TrainingPlan:
    recipe: Recipe
    launch: Launch
    layers: list[int]
    shape: tuple[int, int, int, int]  # vocab, hidden, intermediate, decoder layers
    columns: int  # every table's columns together (layers x intermediate for whole layers)
    device: list[Line] = field(default_factory=list)  # per process, on its device
    host: list[Line] = field(default_factory=list)  # per machine, host memory
    disk: list[Line] = field(default_factory=list)  # OUTPUT's file system
    rows: str = ""  # how the step's distinct ids were counted
    converting: int | None = None  # host memory of converting model.source first, before training (None: init_from)

    @property
    def bf16(self) -> bool:
        return bf16_autocast(self.recipe.train, self.launch.device == "cuda")

    def totals(self) -> tuple[int, int, int]:
        return tuple(sum(line.bytes for line in lines) for lines in (self.device, self.host, self.disk))

    def describe(self) -> str:
        vocab, hidden, d_ff, n = self.shape
        launch = self.launch
        how = (f"{launch.machines} machine(s) x {launch.processes} process(es)"
               + (f", FSDP (dense weights sharded {launch.world} ways)" if launch.fsdp else ", DDP" if launch.world > 1 else "")
               + f", {launch.device}" + (", bf16 autocast" if self.bf16 else ", fp32"))
        device, host, disk = self.totals()
        where = "GPU" if launch.device == "cuda" else "host memory, on top of the machine's share below"
        width = f"{d_ff}" if self.columns == len(self.layers) * d_ff else f"k: {self.columns} columns in all"
        out = [f"plan: {self.recipe.model.source}, STEM layers {','.join(map(str, self.layers))} ({len(self.layers)} of "
               f"{n}), tables [{vocab}, {width}]; {how}",
               f"each process ({where}):"]
        out += [_row(line) for line in self.device] + [_row(Line("total", device))]
        out += ["each machine (host memory):"] + [_row(line) for line in self.host] + [_row(Line("total", host))]
        out += ["OUTPUT's disk:"] + [_row(line) for line in self.disk] + [_row(Line("total", disk))]
        out.append(f"rows per step: {self.rows}")
        if self.converting is not None:
            out.append(f"before training, converting model.source into OUTPUT/init: {self.converting / GB:.2f} GB of "
                       f"host memory (the main process; calibrating processes hold the dense model each)")
        return "\n".join(out)

    def confirm(self, output: Path | None = None, also: list = ()) -> str:
        """A line saying that the run fits this machine, or a PlanError naming everything that does not; `also`:
        what the run downloads and caches besides OUTPUT (hub.DiskNeed: the datasets' files and tokens)."""
        if problems := self.check(output, also):
            raise PlanError("; ".join(problems) + ": the run does not fit this machine as planned")
        gpu = f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ", no GPU: GPU memory not checked"
        return f"fits this machine ({os.cpu_count()} CPUs, {(_available_memory() or 0) / GB:.1f} GB available{gpu})"

    def check(self, output: Path | None = None, also: list = ()) -> list[str]:
        """What does not fit this machine, one line each (empty: everything fits, or could not be checked); `also`:
        what is written besides OUTPUT (hub.DiskNeed), summed with it where they share a disk."""
        device, host, disk = self.totals()
        problems = []
        if self.launch.device == "cpu":
            host += self.launch.processes * device
        host = max(host, self.converting or 0)
        available = _available_memory()
        if available is not None and host > available:
            problems.append(f"host memory: each machine needs {host / GB:.1f} GB, this one has {available / GB:.1f} GB "
                            f"available")
        if self.launch.device == "cuda" and torch.cuda.is_available():
            total = torch.cuda.mem_get_info()[1]
            if device > total:
                problems.append(f"GPU memory: each process needs {device / GB:.1f} GB, this GPU has {total / GB:.1f} GB")
        if output is not None and also:
            from ..hub import DiskNeed, HubError, check_disk

            try:
                check_disk([DiskNeed(output, disk, "OUTPUT"), *also])
            except HubError as err:
                problems.append("disk: " + str(err).split(";")[0].removeprefix("not enough disk space: "))
        elif output is not None:
            from ..atomic import existing_parent

            existing = existing_parent(output)
            free = shutil.disk_usage(existing).free
            if disk > free:
                problems.append(f"disk: OUTPUT needs {disk / GB:.1f} GB, {existing} has {free / GB:.1f} GB free")
        return problems


def _row(line: Line) -> str:
    return f"  {line.what:<52} {line.bytes / GB:>7.2f} GB" + (f"  {line.note}" if line.note else "")


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def plan_training(recipe: Recipe, launch: Launch, source, distinct_rows: int | None = None) -> TrainingPlan:
    """The plan of RECIPE launched as LAUNCH from `source` (model.source, opened: `open_source`);
    `distinct_rows`: ids per step when known (`count_distinct_rows`), else the bound."""
    from ..convert import plan_conversion, resolve_dtype
    from ..source import open_source

    m, t = recipe.model, recipe.train
    if m.init_from:
        student = open_source(m.init_from)
        layers = list(student.config.stem_layers)
        columns = sum(table_columns(student.config, layer) for layer in layers)  # every table's, side by side
        tensors = {n: student.tensors.shape(n) for n in student.tensors.names()}
        converting = None
    else:
        # closed-form: the same tensors as any init, and it needs no calibration text to be planned
        conversion = plan_conversion(source, layers=m.layers, init="closed-form", dtype="float32",
                                     first_token=m.first_token, dry_run=True, columns=m.columns)
        layers = conversion.layers
        columns = sum(table_columns(conversion.config, layer) for layer in layers)
        tensors = {s.name: s.shape for s in conversion.specs}
        # the peak of the conversion itself, with the recipe's init and layer fit (convert's own estimate)
        options = dataclasses.replace(conversion.init_options, calib_tokens=m.calib_tokens,
                                      fit=FitOptions(**dataclasses.asdict(recipe.local)))
        converting = dataclasses.replace(conversion, init=m.init, init_options=options).ram_estimate()
    config = source.config
    vocab, hidden, d_ff, n = config.vocab_size, config.hidden_size, config.intermediate_size, config.num_hidden_layers
    check_batch(t, launch.world)
    plan = TrainingPlan(recipe, launch, layers, (vocab, hidden, d_ff, n), columns, converting=converting)
    teacher = sum(math.prod(source.tensors.shape(name)) for name in source.tensors.names())
    dense = {name: math.prod(shape) for name, shape in tensors.items() if not is_table_tensor(name)}
    trainable = sum(count for name, count in dense.items() if is_trainable(name, t.trainable, layers))
    if "lora" in t.trainable:  # adapters A [r, in] and B [out, r] on every targeted matrix
        targets = recipe.lora.target_modules
        trainable += sum(recipe.lora.r * sum(tensors[name]) for name in dense
                         if name.endswith(".weight") and len(tensors[name]) == 2 and
                         any(f".{target}." in name for target in targets))
    shard = launch.world if launch.fsdp else 1
    width = 2 if plan.bf16 else 4

    def sharded(what: str, count: int, bytes_per: int) -> Line:
        whole = count * bytes_per
        return Line(what, math.ceil(whole / shard), f"1/{shard} of {whole / GB:.2f} GB" if shard > 1 else "")

    # -- each process, on its device
    plan.device.append(Line(f"teacher ({'bf16' if plan.bf16 else 'fp32'}, whole)", teacher * width))
    plan.device.append(sharded("student dense weights (fp32)", sum(dense.values()), 4))
    if launch.fsdp:  # the running layer and the next, prefetched, in the compute dtype
        layer = max(sum(c for name, c in dense.items() if f".layers.{i}." in name) for i in range(n))
        plan.device.append(Line("two decoder layers gathered (FSDP)", 2 * layer * width))
    plan.device.append(sharded("gradients of the trainable weights (fp32)", trainable, 4))
    plan.device.append(sharded("AdamW state (2 x fp32)", trainable, 8))
    bound = vocab if recipe.tables.optimizer == "adamw" else min(vocab, t.batch_size * recipe.data.seq_len)
    rows = bound if distinct_rows is None or recipe.tables.optimizer == "adamw" else min(distinct_rows, bound)
    plan.rows = (f"{rows} distinct ids" + (" (every row: tables.optimizer adamw)" if recipe.tables.optimizer == "adamw"
                 else f" in the first {t.batch_size} x {recipe.data.seq_len} tokens of the training text (an "
                 f"estimate: steps draw their sequences from the whole corpus, which may hold more)"
                 if distinct_rows is not None else f" at most (the vocabulary or a step's {t.batch_size} x "
                 f"{recipe.data.seq_len} tokens; real text has fewer)"))
    tables_train = "tables" in t.trainable
    plan.device.append(Line(f"a step's rows{' and their gradients' if tables_train else ''} (fp32, {len(layers)} tables)",
                            rows * columns * (8 if tables_train else 4), f"{rows} rows"))
    tokens = t.micro_batch_size * recipe.data.seq_len
    # one layer's saved tensors per token: norms, q k v o and residuals (~10 d), the MLP's gate, activation, rows
    # and product (4 d_ff), and on the CPU the attention weights (heads x seq: no flash kernel saves them away)
    probs = config.num_attention_heads * recipe.data.seq_len if launch.device == "cpu" else 0
    working = tokens * (10 * hidden + 4 * d_ff + probs) * width
    saved = n * tokens * hidden * width if t.gradient_checkpointing else n * working
    plan.device.append(Line("activations of a micro-batch (estimate)", saved + working + 3 * LOSS_CHUNK_BYTES,
                            "gradient checkpointing" if t.gradient_checkpointing else "no checkpointing"))
    plan.device.append(Line("runtime (Python, torch" + (", CUDA context)" if launch.device == "cuda" else ")"),
                            RUNTIME_BYTES[launch.device]))
    if source.in_memory_bytes and launch.device == "cpu":  # a GGUF source, dequantised, stays in the process
        plan.device.append(Line("model.source held in memory (dequantised GGUF)", source.in_memory_bytes))

    # -- each machine, host memory
    tables = vocab * columns * 4  # every table's rows, fp32
    # row-wise Adagrad: a float per row; Adam: two floats per element and a step count (int64) per row
    state = {"rowwise_adagrad": len(layers) * vocab * 4, "adam": 2 * tables + len(layers) * vocab * 8}
    state["adamw"] = state["adam"]
    shapes = (f"{len(layers)} x [{vocab}, {d_ff}]" if columns == len(layers) * d_ff
              else f"{len(layers)} x [{vocab}, k], {columns} columns in all")
    plan.host.append(Line(f"tables (fp32, {shapes})", tables, "one copy, mapped by every process"))
    optimizer_state = state[recipe.tables.optimizer] if tables_train else 0  # no optimizer: frozen
    plan.host.append(Line(f"table optimizer state ({recipe.tables.optimizer if tables_train else 'tables frozen'})",
                          optimizer_state))
    if launch.device == "cuda":
        plan.host.append(Line(f"loading: teacher and student per process (x {launch.processes})",
                              launch.processes * (teacher * width + sum(dense.values()) * 4), "until moved to the GPU"))
        if source.in_memory_bytes:  # a GGUF source, dequantised, stays in each process's host memory
            plan.host.append(Line(f"model.source held in memory (dequantised GGUF, x {launch.processes})",
                                  launch.processes * source.in_memory_bytes))

    # -- OUTPUT's disk
    everything = sum(math.prod(s) for s in tensors.values())
    if not m.init_from:
        plan.disk.append(Line("converted starting point (fp32, OUTPUT/init)", everything * 4))
    if t.checkpoint_every:
        each = tables + optimizer_state + sum(dense.values()) * 4 + trainable * 8
        plan.disk.append(Line(f"checkpoints ({t.keep_checkpoints} kept)", t.keep_checkpoints * each))
    if not recipe.tables.host_dir:
        plan.disk.append(Line("tables' host copy (OUTPUT/host-tables)", plan.host[0].bytes + plan.host[1].bytes))
    export = resolve_dtype(m.export_dtype, source)
    plan.disk.append(Line(f"exported model ({str(export).removeprefix('torch.')})", everything * export.itemsize))
    return plan


def count_distinct_rows(recipe: Recipe, source) -> int | None:
    """The distinct ids of one step's worth of the training text (`batch_size` x `seq_len` tokens from its first
    files), tokenised by the tokenizer of `source` (the opened model.source); None when the text or the
    tokenizer is not here."""
    from ..documents import read_documents
    from ..loading import load_tokenizer
    from .data import expand_files

    t = recipe.train
    wanted = t.batch_size * recipe.data.seq_len
    try:
        tokenizer = load_tokenizer(source)
        files = expand_files(recipe.data.train_sources(), "data.train")  # an hf: dataset not fetched yet: None
    except (UserError, OSError, ValueError):
        return None
    ids = []
    for document in read_documents(files, recipe.data.text_field, max_chars=16 * wanted):
        ids += tokenizer(document, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id or 0]
        if len(ids) >= wanted:
            break
    return len(set(ids[:wanted])) if ids else None
