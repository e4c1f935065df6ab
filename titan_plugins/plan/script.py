"""Read the Megatron flags out of a bash launch script without running it.

A small, static subset of bash: assignments (``X=1``, ``export X=...``, ``X=(...)`` arrays,
``X+=(...)``, ``: "${X:=1}"``), expansions (``$X``, ``${X}``, ``${X:-d}``, ``${X-d}``, ``${X:=d}``,
``${X:+w}``, ``${A[@]}``, ``$((arithmetic))``), quotes, comments and line continuations. Variables
start from the environment, so ``PP=8 titan-plugins plan script.sh`` plans what
``PP=8 bash script.sh`` would launch. Control flow is not followed: assignments are applied top to
bottom. The command line that runs the entry script (``pretrain_gpt.py`` by default) gives the
Megatron flags; torchrun's ``--nnodes`` / ``--nproc-per-node`` before it give the world size.
"""

from __future__ import annotations

import ast
import operator
import re
from dataclasses import dataclass, field

from titan_plugins.plan.flags import PlanError

_NAME = r"[A-Za-z_][A-Za-z0-9_]*"
_ASSIGN = re.compile(rf"^({_NAME})(\+?)=(.*)$", re.S)
_ARRAY_START = re.compile(rf"^\s*(?:export\s+|declare\s+-a\s+|local\s+)?({_NAME})(\+?)=\(")
_OPERATORS = {"|", "||", "&&", ";", "&"}


@dataclass
class Launch:
    """What a launch script runs: Megatron flags, world size (if torchrun says) and notes."""

    megatron_args: list[str]
    world_size: int | None
    variables: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


class _Shell:
    """Variables and the bash-subset lexer that expands them."""

    def __init__(self, env: dict[str, str]):
        self.vars: dict[str, str | list[str]] = dict(env)
        self.notes: list[str] = []

    # -- expansion -------------------------------------------------------------------------------
    def _scalar(self, name: str) -> str | None:
        value = self.vars.get(name)
        if isinstance(value, list):
            return value[0] if value else ""
        return value

    def _arith(self, expr: str) -> str:
        expr = re.sub(r"\$\{?(" + _NAME + r")\}?", r"\1", expr)
        expr = re.sub(_NAME, lambda m: self._scalar(m.group(0)) or "0", expr)
        ops = {
            ast.Add: operator.add,
            ast.Sub: operator.sub,
            ast.Mult: operator.mul,
            ast.Div: operator.floordiv,
            ast.FloorDiv: operator.floordiv,
            ast.Mod: operator.mod,
        }

        def ev(node: ast.AST) -> int:
            if isinstance(node, ast.Constant) and isinstance(node.value, int):
                return node.value
            if isinstance(node, ast.BinOp) and type(node.op) in ops:
                return ops[type(node.op)](ev(node.left), ev(node.right))
            if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
                return -ev(node.operand)
            raise PlanError(f"cannot evaluate $(({expr})) in the launch script")

        try:
            return str(ev(ast.parse(expr.strip(), mode="eval").body))
        except SyntaxError as exc:
            raise PlanError(f"cannot evaluate $(({expr})) in the launch script") from exc

    def _braced(self, body: str) -> list[str] | str:
        """Expand ``${...}``; a list means separate words (``${A[@]}``)."""
        m = re.fullmatch(rf"({_NAME})\[[@*]\]", body)
        if m:
            value = self.vars.get(m.group(1), [])
            return list(value) if isinstance(value, list) else [value]
        m = re.fullmatch(rf"({_NAME})(:?[-=+])?(.*)", body, re.S)
        if not m:
            raise PlanError(f"unsupported expansion ${{{body}}} in the launch script")
        name, op, word = m.group(1), m.group(2), m.group(3)
        value = self._scalar(name)
        if op is None:
            return value or ""
        unset = value is None or (op.startswith(":") and value == "")
        word_value = self.expand_text(word)
        if op.endswith("-"):
            return word_value if unset else value
        if op.endswith("="):
            if unset:
                self.vars[name] = word_value
                return word_value
            return value
        return "" if unset else word_value  # ":+" / "+"

    def expand_text(self, text: str) -> str:
        """Expand all ``$`` constructs and quotes of ``text`` into one string (no splitting)."""
        return "".join(self.lex(text, split=False))

    # -- lexing ----------------------------------------------------------------------------------
    def _dollar(self, s: str, i: int) -> tuple[list[str] | str, int]:
        if s.startswith("$((", i):
            end = s.find("))", i)
            if end < 0:
                raise PlanError("unterminated $(( in the launch script")
            return self._arith(s[i + 3 : end]), end + 2
        if s.startswith("$(", i):
            depth, j = 1, i + 2
            while j < len(s) and depth:
                depth += {"(": 1, ")": -1}.get(s[j], 0)
                j += 1
            self.notes.append(f"command substitution {s[i:j]} is not run; expanded to ''")
            return "", j
        if s.startswith("${", i):
            depth, j = 1, i + 2
            while j < len(s) and depth:
                depth += {"{": 1, "}": -1}.get(s[j], 0)
                j += 1
            end = j - 1
            return self._braced(s[i + 2 : end]), end + 1
        m = re.compile(_NAME + r"|[0-9#@*?$]").match(s, i + 1)
        if not m:
            return "$", i + 1
        return self._scalar(m.group(0)) or "", m.end()

    def lex(self, s: str, split: bool = True) -> list[str]:
        """Split ``s`` into words with quotes removed and expansions applied, like bash."""
        words: list[str] = []
        cur: list[str] = []
        has_word = False
        i, n = 0, len(s)

        def flush() -> None:
            nonlocal cur, has_word
            if has_word:
                words.append("".join(cur))
            cur, has_word = [], False

        while i < n:
            c = s[i]
            if c == "\\" and i + 1 < n:
                if s[i + 1] != "\n":
                    cur.append(s[i + 1])
                    has_word = True
                i += 2
            elif c in " \t\n":
                if split:
                    flush()
                else:
                    cur.append(c)
                i += 1
            elif c == "#" and not has_word:
                j = s.find("\n", i)
                i = n if j < 0 else j
            elif c == "'":
                j = s.find("'", i + 1)
                cur.append(s[i + 1 : j])
                has_word, i = True, j + 1
            elif c == '"':
                i += 1
                has_word = True
                while i < n and s[i] != '"':
                    if s[i] == "\\" and i + 1 < n and s[i + 1] in '"\\$`':
                        cur.append(s[i + 1])
                        i += 2
                    elif s[i] == "$":
                        value, i = self._dollar(s, i)
                        if isinstance(value, list):  # "${A[@]}": one word per element
                            if value:
                                cur.append(value[0])
                                for element in value[1:]:
                                    flush()
                                    cur, has_word = [element], True
                        else:
                            cur.append(value)
                    else:
                        cur.append(s[i])
                        i += 1
                i += 1
            elif c == "$":
                value, i = self._dollar(s, i)
                parts = value if isinstance(value, list) else value.split() if split else [value]
                in_assignment = bool(re.match(rf"^{_NAME}\+?=", "".join(cur)))
                if isinstance(value, str) and (not split or in_assignment):
                    cur.append(value)
                    has_word = has_word or bool(value)
                    continue
                for k, part in enumerate(parts):
                    if k:
                        flush()
                    cur.append(part)
                    has_word = True
            else:
                cur.append(c)
                has_word = True
                i += 1
        flush()
        return words


def _parens(raw: str) -> int:
    """Net ``(`` minus ``)`` of one line, outside quotes and comments."""
    depth, quote = 0, ""
    for k, c in enumerate(raw):
        if quote:
            quote = "" if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "#" and (k == 0 or raw[k - 1] in " \t"):
            break
        else:
            depth += {"(": 1, ")": -1}.get(c, 0)
    return depth


def _logical_lines(text: str) -> list[str]:
    """Join continuation lines and multi-line ``X=( ... )`` arrays into logical lines."""
    lines, buf, depth = [], "", 0
    for raw in text.splitlines():
        buf += raw + "\n"
        if depth or _ARRAY_START.match(buf):
            depth += _parens(raw)
            if depth > 0:
                continue
            depth = 0
        if raw.endswith("\\"):
            buf = buf[:-2]
            continue
        lines.append(buf)
        buf = ""
    if buf.strip():
        lines.append(buf)
    return lines


def _world_size(launcher_words: list[str]) -> int | None:
    opts: dict[str, str] = {}
    for k, word in enumerate(launcher_words):
        key, eq, val = word.partition("=")
        key = key.replace("_", "-")
        if key in ("--nnodes", "--nproc-per-node"):
            opts[key] = val if eq else launcher_words[k + 1]
    try:
        nnodes = int(opts.get("--nnodes", "1").split(":")[-1])
        nproc = int(opts["--nproc-per-node"]) if "--nproc-per-node" in opts else None
    except ValueError:
        return None
    return None if nproc is None else nnodes * nproc


def read_launch_script(text: str, env: dict[str, str], entry: str = "pretrain_gpt.py") -> Launch:
    """Extract the Megatron flags and world size from a launch script's text.

    ``env`` is the starting environment (e.g. ``os.environ``). Raises ``PlanError`` when no command
    line runs ``entry``.
    """
    shell = _Shell(env)
    found: Launch | None = None
    for line in _logical_lines(text):
        m = _ARRAY_START.match(line)
        if m:
            body = line[m.end() : line.rindex(")")]
            values = shell.lex(body)
            old = shell.vars.get(m.group(1), [])
            old_list = old if isinstance(old, list) else [old]
            shell.vars[m.group(1)] = (old_list if m.group(2) else []) + values
            continue
        words = shell.lex(line)
        while words and words[0] in ("export", "readonly", "local", "declare"):
            words = words[1:]
        if words and all(_ASSIGN.match(w) for w in words):
            for w in words:
                name, plus, value = _ASSIGN.match(w).groups()
                old = shell._scalar(name) or "" if plus else ""
                shell.vars[name] = old + value
            continue
        entry_at = [k for k, w in enumerate(words) if w.rsplit("/", 1)[-1] == entry]
        if entry_at:
            k = entry_at[0]
            rest = words[k + 1 :]
            for j, w in enumerate(rest):
                if w in _OPERATORS or re.match(r"^\d*[<>]", w):
                    rest = rest[:j]
                    break
            found = Launch(rest, _world_size(words[:k]), notes=shell.notes)
    if found is None:
        raise PlanError(f"no command line running {entry} found in the launch script")
    found.variables = {k: v for k, v in shell.vars.items() if isinstance(v, str) and k not in env}
    return found
