"""The course map: the chapters in four stages and 10 labs, declared once.

Everything that lists the course is made from :data:`STAGES` and :data:`LABS`: the landing
page that ``make course`` opens (``COURSE.md``), the README's table of chapters
(``tools/build_course_map.py`` writes both) and the static book's sidebar (``make book``,
``tools/build_book.py``). Titles are the syllabus's; which chapters and labs are written is
read from the files that exist (``chapters/NN_slug.ipynb``, ``labs/LNN_slug.ipynb``), so a
new notebook is linked as soon as the map is rebuilt, and the others are shown as coming,
without a link. ``tests/test_course_map.py`` fails when a notebook's title disagrees with
the map or a generated file is out of date.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

COMING = "即将推出"
_CN = dict(enumerate("零一二三四五六七八九"))


@dataclass(frozen=True)
class Stage:
    title: str          # "第一阶段 · 基础原理篇"
    question: str       # the kind of question the stage answers
    chapters: tuple[tuple[int, str], ...]   # (number, title)
    note: str = ""      # a paragraph under the stage's table on the landing page

    @property
    def span(self) -> str:
        return f"第 {self.chapters[0][0]}–{self.chapters[-1][0]} 章"


@dataclass(frozen=True)
class LabEntry:
    lab_id: str         # "L03"
    title: str
    chapters: tuple[int, ...]


STAGES = (
    Stage("第一阶段 · 基础原理篇", "为什么动态批处理有效、瓶颈在哪里", (
        (1, "课程导入：动态批处理的价值与挑战"),
        (2, "Prefill 与 Decode：两阶段的计算与访存"),
        (3, "请求调度的第一性原理：排队论视角"),
        (4, "批聚合策略：静态批处理与动态批处理窗口"),
        (5, "迭代级调度：连续批处理"),
        (6, "KV Cache 与显存管理基础"),
        (7, "PagedAttention：分页 KV 与块管理器"),
        (8, "评估体系与压测方法论"),
    )),
    Stage("第二阶段 · 工程实践篇", "主流框架怎么实现、参数怎么调", (
        (9, "minibatch 源码导读：一次 step 的生命周期"),
        (10, "vLLM 的连续批处理与关键参数"),
        (11, "分块预填充（Chunked Prefill）与混合批"),
        (12, "抢占：Recompute 与 Swap"),
        (13, "前缀缓存（Prefix Caching）"),
        (14, "RadixAttention 与缓存感知调度"),
        (15, "TensorRT-LLM 的 In-flight Batching"),
        (16, "TGI 路由器的批处理参数"),
        (17, "Triton Kernel 实战"),
        (18, "采样、停止条件与流式输出"),
        (19, "参数调优：在 SLA 下寻找帕累托前沿"),
        (20, "框架横评：同一负载下的四种风格"),
    ), note=("关于 TGI：Hugging Face 的 text-generation-inference 已进入维护模式（Maintenance Mode）——"
             "它的 README 开头的 CAUTION 写道 “text-generation-inference is now in maintenance mode”"
             "（2025-12-11，commit `55f7f7cb`，PR #3344）：今后只接受小的修复与文档改进，并推荐改用 vLLM、SGLang。"
             "第 16 章仍读它的路由器：它按 Token 预算（`max_batch_prefill_tokens`、`max_batch_total_tokens`）组批，是理解批处理预算的又一种思路。")),
    Stage("第三阶段 · 生产进阶篇", "大规模生产环境的全局优化", (
        (21, "长尾请求与队头阻塞"),
        (22, "优先级调度、QoS 与优先级反转"),
        (23, "抢占式多级反馈队列与公平性"),
        (24, "显存碎片诊断与治理"),
        (25, "多模型部署"),
        (26, "多副本全局调度与负载均衡"),
        (27, "Prefill/Decode 分离"),
        (28, "弹性伸缩"),
        (29, "故障排查手册"),
        (30, "容量规划与综合案例复盘"),
    )),
    Stage("第四阶段 · 前沿篇（2025–2026）", "主流引擎在 2025–2026 年新增的批处理特性，怎么在同一个引擎里度量", (
        (31, "异步调度：让调度与计算重叠（Async Scheduling）"),
        (32, "批内投机解码（Speculative Decoding）"),
        (33, "KV 卸载分层：扩展前缀缓存（KV Offload）"),
    )),
)

LABS = (
    LabEntry("L01", "从事件日志计算 TTFT、TPOT、ITL 与 Goodput", (8,)),
    LabEntry("L02", "动态批处理窗口策略（max_batch_size, max_wait）", (4,)),
    LabEntry("L03", "迭代级调度：连续批处理的一步", (5,)),
    LabEntry("L04", "分页块管理器：分配、追加、释放与写时复制", (7,)),
    LabEntry("L05", "用 Triton 写分页注意力解码内核（CPU 上用解释器运行）", (7, 17)),
    LabEntry("L06", "Token 预算下的分块预填充（Chunked Prefill）", (11,)),
    LabEntry("L07", "抢占与抢占对象的选择", (12,)),
    LabEntry("L08", "基数树：前缀匹配、插入与驱逐", (13, 14)),
    LabEntry("L09", "SJF 与 MLFQ 调度策略", (21, 23)),
    LabEntry("L10", "多副本路由器（Router）", (26,)),
)

LAB_CHECK = "python -m minibatch.labs check L01 workspace/labs/L01_metrics.ipynb"


def chapter_titles() -> dict[int, str]:
    return {n: t for s in STAGES for n, t in s.chapters}


def chapter_files(root: Path = ROOT) -> dict[int, str]:
    """``{number: "chapters/NN_slug.ipynb"}`` for the chapters written so far."""
    out = {}
    for p in sorted((root / "chapters").glob("[0-9][0-9]_*.ipynb")):
        out[int(p.name[:2])] = f"chapters/{p.name}"
    return out


def lab_files(root: Path = ROOT) -> dict[str, str]:
    """``{"L01": "labs/L01_slug.ipynb"}`` for the labs written so far."""
    return {p.name[:3]: f"labs/{p.name}" for p in sorted((root / "labs").glob("L[0-9][0-9]_*.ipynb"))}


def notebook_title(path: Path) -> str:
    """The first ``# `` heading of a notebook's first Markdown cell."""
    nb = json.loads(Path(path).read_text(encoding="utf-8"))
    for cell in nb["cells"]:
        if cell["cell_type"] == "markdown":
            for line in "".join(cell["source"]).splitlines():
                if line.startswith("# "):
                    return line[2:].strip()
    return ""


def title_in_notebook(heading: str) -> str:
    """``"第 1 章　课程导入：…"`` -> ``"课程导入：…"``; ``"L01 · 从事件…"`` -> ``"从事件…"``."""
    heading = re.sub(r"^第\s*\d+\s*章\s*", "", heading.strip())
    return re.sub(r"^L\d\d\s*·\s*", "", heading).strip()


def _lab_link(lab: LabEntry, labs: dict[str, str], with_title: bool = True) -> str:
    text = f"{lab.lab_id} {lab.title}" if with_title else lab.lab_id
    return f"[{text}]({labs[lab.lab_id]})" if lab.lab_id in labs else f"{text}（{COMING}）"


def _chapters_of(lab: LabEntry, chapters: dict[int, str]) -> str:
    parts = []
    for n in lab.chapters:
        parts.append(f"[第 {n} 章]({chapters[n]})" if n in chapters else f"第 {n} 章")
    return "、".join(parts)


def stage_table(stage: Stage, chapters: dict[int, str], labs: dict[str, str]) -> str:
    """A Markdown table of one stage: number, chapter (a link when written), its labs."""
    rows = ["| # | 章节 | 实验 |", "|---|---|---|"]
    for n, title in stage.chapters:
        cell = f"[{title}]({chapters[n]})" if n in chapters else f"{title} · *{COMING}*"
        its_labs = [lab for lab in LABS if n in lab.chapters]
        rows.append(f"| {n:02d} | {cell} | {'<br>'.join(_lab_link(l, labs) for l in its_labs)} |")
    return "\n".join(rows)


def labs_table(chapters: dict[int, str], labs: dict[str, str]) -> str:
    rows = ["| 实验 | 主题 | 对应章节 |", "|---|---|---|"]
    for lab in LABS:
        topic = f"[{lab.title}]({labs[lab.lab_id]})" if lab.lab_id in labs else f"{lab.title} · *{COMING}*"
        rows.append(f"| {lab.lab_id} | {topic} | {_chapters_of(lab, chapters)} |")
    return "\n".join(rows)


def landing_cells(root: Path = ROOT) -> list[str]:
    """The landing page's sections in Markdown (Chinese prose, English code), links relative to
    ``root``. Chinese paragraphs are single lines: a line break inside one renders as a space."""
    chapters, labs = chapter_files(root), lab_files(root)
    first = chapters.get(1, "chapters/")
    complete = len(chapters) == len(chapter_titles()) and len(labs) == len(LABS)
    written = "" if complete else f"目前已写成 {len(chapters)} 章、{len(labs)} 个实验，其余标为“{COMING}”。"
    intro = "\n\n".join([
        "# minibatch：LLM 推理服务中的动态批处理（Dynamic Batching）",
        f"欢迎！这是课程的首页与课程地图。全课 {len(chapter_titles())} 章分{_CN[len(STAGES)]}个阶段，另有 {len(LABS)} 个实验（Labs）；"
        f"{written}每一章都是一个 Jupyter Notebook："
        "讲解用简体中文，关键术语附英文，代码用英文；所有实验都由同一个紧凑的推理引擎 **minibatch** 驱动——"
        "在 CPU 上跑真实的小模型 `tiny`，或在模拟器里让 LLaMA-7B/13B/70B “跑”在 A10、A100、H100 上。",
        f"**怎么读。** 从 [第 1 章]({first}) 开始。打开的 Notebook 已保存了全部输出（图、表、数字），可以先读；"
        "再从上到下运行（菜单 *Run ▸ Run All Cells*），结果应当与保存的一致（墙钟时间的数字除外）。"
        "内核（Kernel）选默认的 *Python 3*，它就是 `.venv` 里的解释器，`import minibatch` 直接可用。"
        "想离线通读全书，在终端运行 `make book`，它生成静态网页版 `_build/book/index.html`。",
        "**你的工作副本。** 运行一个 Notebook 会把输出写进它自己，所以 `make course` 打开的是你的工作副本 `workspace/`"
        "（在仓库根目录，不进 Git）：第一次启动时从 `chapters/` 与 `labs/` 复制全部 Notebook，之后的启动从不覆盖它们"
        "（课程新增的 Notebook 会补进来）。你可以随意运行、修改；仓库里的原件保持不变，`git pull` 也不会与你的改动冲突。"
        "想让某一章恢复原样，在终端（仓库根目录）运行 `.venv/bin/python -m minibatch.labs reset 05`"
        "（实验用 `reset L03`），你的旧副本另存为同名的 `.ipynb.bak`。",
    ])
    cells = [intro]
    for stage in STAGES:
        cells.append(f"## {stage.title}（{stage.span}）\n\n解决的问题：{stage.question}。\n\n"
                     + stage_table(stage, chapters, labs) + (f"\n\n{stage.note}" if stage.note else ""))
    cells.append("\n\n".join([
        "## 实验（Labs）",
        "每个实验是一个带任务单元格（`task:N` 标签）的 Notebook：把其中的 `raise NotImplementedError(...)` "
        "换成你的实现，紧随其后的检查单元格（`check:N`）会断言结果，并把你的代码插进真实的引擎里运行。",
        labs_table(chapters, labs),
        "**怎么评分（Lab Check）。** 做完后在终端（仓库根目录）运行，例如：",
        f"```bash\n.venv/bin/{LAB_CHECK}\n```",
        "每个任务打印 ✓ 或 ✗ 及失败原因；全部通过时退出码为 0。路径是你在 `workspace/` 里的副本（`make course` "
        "打开的那一份）。`.venv/bin/python -m minibatch.labs list` 列出全部实验与任务；"
        "评分规则详见 [实验指南](labs/README.md)。",
    ]))
    cells.append("\n".join([
        "## 数据从哪里来：负载与 Trace",
        "",
        "- **命名负载（Workload）**：`load_workload(\"chat\")` 等五个负载（`chat`、`code_bursty`、`rag`、`long_tail`、"
        "`shared_prefix`）都在代码里按固定随机种子生成（`minibatch.workload`），运行时不读文件，也不联网。"
        "`chat` 与 `code_bursty` 的到达过程与长度分布拟合自微软公开的 Azure LLM 推理 trace 2023"
        "（Splitwise, Patel et al., ISCA'24；CC-BY-4.0），其余是设计值。同样的负载另存为 "
        "`datasets/workloads/*.jsonl`，供查看与其他工具使用。",
        "- **真实 trace**：课程用到的公开 trace 随仓库放在 `datasets/traces/`（Azure LLM 推理 trace 2023 的 code 与 conv、"
        "Mooncake 合成 trace、ShareGPT-8k 长度统计），与原文件逐字节相同，来源、许可（CC-BY-4.0、Apache-2.0）与校验和见 "
        "[datasets/traces/SOURCES.md](datasets/traces/SOURCES.md)；用 `load_shipped_trace(\"azure_conv\")` 读入。"
        "拟合方法与“生成 vs 公开”的对照表见 [数据说明](datasets/README.md)。",
        "- **模型**：默认模型 `tiny`（约 400 万参数的 Llama 结构）随包内置，训练语料由程序生成"
        "（`.venv/bin/python -m minibatch.tiny.train`），无需从网上下载任何权重。",
    ]))
    return cells


def landing_page(root: Path = ROOT) -> str:
    """``COURSE.md``, the page ``make course`` opens first (JupyterLab's Markdown preview)."""
    return "\n\n".join(landing_cells(root)) + "\n"


README_START = "<!-- course-map: made by tools/build_course_map.py from minibatch/labs/course.py -->"
README_END = "<!-- /course-map -->"


def readme_table(root: Path = ROOT) -> str:
    """The README's table: the chapters written so far with their labs, then what is coming."""
    chapters, labs = chapter_files(root), lab_files(root)
    titles = chapter_titles()
    rows = ["| # | chapter | lab |", "|---|---|---|"]
    for n in sorted(chapters):
        its = [lab for lab in LABS if lab.lab_id in labs and lab.chapters[0] == n]
        rows.append(f"| {n:02d} | [{titles[n]}]({chapters[n]}) | {'<br>'.join(_lab_link(l, labs) for l in its)} |")
    coming = [n for n in titles if n not in chapters]
    coming_labs = [int(lab.lab_id[1:]) for lab in LABS if lab.lab_id not in labs]
    tail = ""
    if coming:
        tail = (f"\n\nComing, in the same form: chapter{'s' if len(coming) > 1 else ''} {_ranges(coming)}"
                + (f" and labs {_ranges(coming_labs, 'L')}" if coming_labs else "")
                + ". The landing page [`COURSE.md`](COURSE.md) (what `make course` opens first) maps all "
                  f"{len(titles)} chapters and {len(LABS)} labs.")
    return "\n".join([README_START, "\n".join(rows) + tail, README_END])


def _ranges(ns: list[int], prefix: str = "") -> str:
    """``[9, 10, 11, 30]`` -> ``"09–11, 30"``."""
    out, start, prev = [], ns[0], ns[0]
    for n in ns[1:] + [None]:
        if n is not None and n == prev + 1:
            prev = n
            continue
        out.append(f"{prefix}{start:02d}" if start == prev else f"{prefix}{start:02d}–{prefix}{prev:02d}")
        if n is not None:
            start = prev = n
    return ", ".join(out)


def with_readme_table(readme: str, root: Path = ROOT) -> str:
    """``readme`` with the text between the course-map markers replaced by :func:`readme_table`."""
    pattern = re.compile(re.escape(README_START) + r".*?" + re.escape(README_END), re.S)
    if not pattern.search(readme):
        raise ValueError("README.md has no course-map markers")
    return pattern.sub(lambda _: readme_table(root), readme, count=1)
