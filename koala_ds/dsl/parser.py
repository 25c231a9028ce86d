"""Parser for `.koala` text: indentation-structured lines, each tokenized and parsed by
recursive descent. Every error is a `KoalaSyntaxError` with file:line:col, the offending
line with a caret, and what was expected."""
from __future__ import annotations

import re
from dataclasses import dataclass, replace

from ..core.ir import OP_NAMES, KoalaError
from . import ast as A

OPS = frozenset(OP_NAMES)  # the op names, from the one op table (koala_ds.core.ir.OpIndex)
KEYWORDS = {"let", "for", "in", "if", "else", "rank", "slot", "and", "or", "not"}
HEADERS = ("schedule", "description", "source", "supports", "placement", "backward", "compact", "let", "rank")
COMPACT_MODES = ("greedy",)
FUNCTIONS = {"min": (1, None), "max": (1, None), "abs": (1, 1)}
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*$")
#: How deep parentheses, unary '-' / 'not', function calls, op groups and indented blocks may
#: nest. A flat chain (`1 + 1 + ...`, `a and b and ...`) of any length is fine.
MAX_NESTING = 64


SHOWN_LINE, SHOWN_BEFORE_CARET = 120, 60  # how much of a long source line an error shows
MAX_DIGITS = 18  # a literal's digits: counts of a schedule are far below; Python stops converting at 4300


class KoalaSyntaxError(KoalaError):
    """A `.koala` program that does not parse."""

    def __init__(self, message: str, pos: A.Pos, expected: str = ""):
        self.pos, self.expected, self.reason = pos, expected, message
        start = max(0, pos.col - 1 - SHOWN_BEFORE_CARET)  # a long line: the part around the caret
        shown = ("..." if start else "") + pos.text[start:start + SHOWN_LINE] + \
            ("..." if len(pos.text) > start + SHOWN_LINE else "")
        caret = " " * (pos.col - 1 - start + (3 if start else 0)) + "^"
        exp = f"; expected {expected}" if expected else ""
        super().__init__(f"{pos}: {message}{exp}\n    {shown}\n    {caret}")


_TOKEN_RE = re.compile(r"""
    (?P<ws>\s+)
  | (?P<num>\d+)
  | (?P<name>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<str>"(?:[^"\\]|\\.)*")
  | (?P<op>//|\.\.|==|!=|<=|>=|[-+*%()\[\]@?,:|=<>/])
""", re.VERBOSE)


@dataclass(frozen=True)
class Tok:
    kind: str  # num name str op end
    text: str
    pos: A.Pos


def tokenize(text: str, line: int, col0: int, file: str, full: str) -> list[Tok]:
    toks, i = [], 0
    while i < len(text):
        m = _TOKEN_RE.match(text, i)
        pos = A.Pos(file, line, col0 + i, full)
        if not m:
            raise KoalaSyntaxError(f"unexpected character {text[i]!r}", pos,
                                   "a name, a number, an op (F B I W) or an operator")
        if m.lastgroup != "ws":
            toks.append(Tok(m.lastgroup, m.group(), pos))
        i = m.end()
    toks.append(Tok("end", "end of line", A.Pos(file, line, col0 + len(text), full)))
    return toks


@dataclass
class Line:
    number: int
    indent: int
    content: str  # comment stripped, no leading indent
    full: str
    children: list["Line"]


def _strip_comment(raw: str) -> str:
    out, in_str = [], False
    for ch in raw:
        if ch == '"':
            in_str = not in_str
        if ch == "#" and not in_str:
            break
        out.append(ch)
    return "".join(out).rstrip()


def _line_tree(text: str, file: str) -> list[Line]:
    roots: list[Line] = []
    stack: list[Line] = []
    for number, raw in enumerate(text.splitlines(), 1):
        if "\t" in raw[: len(raw) - len(raw.lstrip())]:
            raise KoalaSyntaxError("tab in indentation", A.Pos(file, number, 1, raw), "spaces")
        content = _strip_comment(raw)
        if not content.strip():
            continue
        indent = len(content) - len(content.lstrip())
        line = Line(number, indent, content.strip(), raw, [])
        while stack and stack[-1].indent >= indent:
            stack.pop()
        if len(stack) > MAX_NESTING:
            raise KoalaSyntaxError(f"blocks nested more than {MAX_NESTING} deep (MAX_NESTING)",
                                   A.Pos(file, number, indent + 1, raw), "fewer nested 'for' / 'if' blocks")
        if stack:
            if not stack[-1].content.endswith(":"):
                raise KoalaSyntaxError("unexpected indentation", A.Pos(file, number, indent + 1, raw),
                                       "a line at the same indentation as the one above")
            stack[-1].children.append(line)
        else:
            if indent and roots:
                raise KoalaSyntaxError("unexpected indentation", A.Pos(file, number, indent + 1, raw),
                                       "a top-level line")
            roots.append(line)
        stack.append(line)
    return roots


class _Tokens:
    def __init__(self, line: Line, file: str, start: int = 0):
        self.line, self.file = line, file
        self.toks = tokenize(line.content[start:], line.number, line.indent + start + 1, file, line.full)
        self.i = 0
        self.depth = 0  # nesting of the construct being parsed

    def enter(self, tok: Tok) -> None:
        self.depth += 1
        if self.depth > MAX_NESTING:
            raise KoalaSyntaxError(f"nested more than {MAX_NESTING} deep (MAX_NESTING)", tok.pos,
                                   "fewer levels of parentheses, '-', 'not' or calls")

    @property
    def cur(self) -> Tok:
        return self.toks[self.i]

    def next(self) -> Tok:
        tok = self.toks[self.i]
        self.i = min(self.i + 1, len(self.toks) - 1)
        return tok

    def at(self, *texts: str) -> bool:
        return self.cur.kind in ("op", "name") and self.cur.text in texts

    def expect(self, text: str, what: str | None = None) -> Tok:
        if not self.at(text):
            self.fail(what or repr(text))
        return self.next()

    def fail(self, expected: str, message: str | None = None):
        tok = self.cur
        found = "end of line" if tok.kind == "end" else repr(tok.text)
        raise KoalaSyntaxError(message or f"unexpected {found}", tok.pos, expected)

    def end(self, expected: str = "end of line") -> None:
        if self.cur.kind != "end":
            self.fail(expected)

    # -- expressions --------------------------------------------------------------------
    def expr(self) -> A.Expr:
        return self.chain("or", self.and_expr)

    def and_expr(self) -> A.Expr:
        return self.chain("and", self.not_expr)

    def chain(self, op: str, operand) -> A.Expr:
        """`operand (op operand)*`, left-associative, in a loop (no recursion per term)."""
        left = operand()
        while self.at(op):
            pos = self.next().pos
            left = A.Binary(op, left, operand(), pos=pos)
        return left

    def not_expr(self) -> A.Expr:
        if self.at("not"):
            return self.prefix("not", self.not_expr)
        return self.comparison()

    def prefix(self, op: str, operand) -> A.Expr:
        """`op operand`: one nesting level deeper (MAX_NESTING)."""
        self.enter(self.cur)
        pos = self.next().pos
        out = A.Unary(op, operand(), pos=pos)
        self.depth -= 1
        return out

    def comparison(self) -> A.Expr:
        left = self.arith()
        if self.at("==", "!=", "<", "<=", ">", ">="):
            tok = self.next()
            left = A.Binary(tok.text, left, self.arith(), pos=tok.pos)
            if self.at("==", "!=", "<", "<=", ">", ">="):
                self.fail("'and' between comparisons", "chained comparison")
        return left

    def arith(self) -> A.Expr:
        left = self.term()
        while self.at("+", "-"):
            tok = self.next()
            left = A.Binary(tok.text, left, self.term(), pos=tok.pos)
        return left

    def term(self) -> A.Expr:
        left = self.unary()
        while self.at("*", "//", "%", "/"):
            tok = self.next()
            if tok.text == "/":
                raise KoalaSyntaxError("'/' is not integer division", tok.pos, "'//'")
            left = A.Binary(tok.text, left, self.unary(), pos=tok.pos)
        return left

    def unary(self) -> A.Expr:
        if self.at("-"):
            return self.prefix("-", self.unary)
        return self.atom()

    def atom(self) -> A.Expr:
        tok = self.cur
        if tok.kind == "num":
            if len(tok.text.lstrip("0")) > MAX_DIGITS:
                raise KoalaSyntaxError(f"number too large ({len(tok.text)} digits)", tok.pos,
                                       f"at most {MAX_DIGITS} digits")
            self.next()
            return A.Num(int(tok.text), pos=tok.pos)
        if tok.kind == "name" and tok.text not in KEYWORDS and tok.text not in OPS:
            self.next()
            if self.at("("):
                if tok.text not in FUNCTIONS:
                    raise KoalaSyntaxError(f"unknown function {tok.text!r}", tok.pos,
                                           "one of " + ", ".join(FUNCTIONS))
                self.enter(self.next())
                args = [self.expr()]
                while self.at(","):
                    self.next()
                    args.append(self.expr())
                self.expect(")", "',' or ')'")
                self.depth -= 1
                lo, hi = FUNCTIONS[tok.text]
                if len(args) < lo or (hi is not None and len(args) > hi):
                    raise KoalaSyntaxError(f"{tok.text}() takes {lo if hi == lo else f'at least {lo}'} "
                                           f"argument(s), got {len(args)}", tok.pos)
                return A.Call(tok.text, tuple(args), pos=tok.pos)
            return A.Name(tok.text, pos=tok.pos)
        if self.at("("):
            self.enter(self.next())
            inner = self.expr()
            self.expect(")", "')'")
            self.depth -= 1
            return inner
        self.fail("a number, a name, '(' or a function call")

    def factor(self) -> A.Expr:
        """A repetition count or explicit microbatch: number, name, call or (expression)."""
        if self.at("-"):
            self.fail("a number, a name or a parenthesized expression")
        return self.atom()

    # -- op sequences -------------------------------------------------------------------
    def items(self, closing: str | None = None) -> tuple[A.Item, ...]:
        out: list[A.Item] = []
        while not (self.cur.kind == "end" or (closing and self.at(closing))):
            if out and isinstance(out[-1], A.Repeat) and self.at("+", "-", "*", "/", "//", "%"):
                self.fail("parentheses around a computed count, e.g. F * (m - k)",
                          f"unexpected {self.cur.text!r} after a repetition count")
            out.append(self.item())
        if not out:
            self.fail("an op (F, B, I, W) or '('")
        return tuple(out)

    def item(self) -> A.Item:
        tok = self.cur
        if self.at("("):
            self.enter(self.next())
            inner = self.items(")")
            self.expect(")", "an op or ')'")
            self.depth -= 1
            item: A.Item = A.Group(inner, pos=tok.pos)
        elif tok.kind == "name" and tok.text in OPS:
            self.next()
            chunk = mb = None
            if self.at("["):
                self.next()
                chunk = self.expr()
                self.expect("]", "']'")
            if self.at("@"):
                self.next()
                mb = self.factor()
            optional = False
            if self.at("?"):
                self.next()
                optional = True
            item = A.OpItem(tok.text, chunk, mb, optional, pos=tok.pos)
        else:
            self.fail("an op (F, B, I, W) or '('")
        if self.at("*"):
            pos = self.next().pos
            item = A.Repeat(item, self.factor(), pos=pos)
        return item


class Parser:
    def __init__(self, text: str, file: str = "<string>"):
        self.text, self.file = text, file

    def pos(self, line: Line, col: int = 0) -> A.Pos:
        return A.Pos(self.file, line.number, line.indent + col + 1, line.full)

    def parse(self) -> A.ProgramAst:
        roots = _line_tree(self.text, self.file)
        name = description = source = ""
        backward = "full"
        placement = A.PlacementSpec("linear")
        supports: list[A.Requirement] = []
        lets: list[A.Let] = []
        ranks: dict = {}
        compact: A.CompactSpec | None = None
        seen: set[str] = set()
        for line in roots:
            word = line.content.split(None, 1)[0].rstrip(":")
            rest_at = len(line.content.split(None, 1)[0]) if line.content.split(None, 1) else 0
            if word not in HEADERS:
                raise KoalaSyntaxError(f"unknown statement {word!r} at top level", self.pos(line),
                                       "one of: " + ", ".join(HEADERS))
            if word in ("schedule", "description", "source", "placement", "backward", "compact") and word in seen:
                raise KoalaSyntaxError(f"second {word!r} line", self.pos(line))
            seen.add(word)
            if word != "rank" and line.children:
                raise KoalaSyntaxError("unexpected indented block", self.pos(line.children[0]))
            rest = line.content[rest_at:].strip()
            if word == "schedule":
                if not NAME_RE.match(rest):
                    raise KoalaSyntaxError(f"bad schedule name {rest!r}", self.pos(line, rest_at + 1),
                                           "a name of letters, digits, '-', '_', '.' or '+'")
                name = rest
            elif word in ("description", "source"):
                toks = _Tokens(line, self.file, rest_at)
                if toks.cur.kind != "str":
                    toks.fail('a quoted string, e.g. "text"')
                value = bytes(toks.next().text[1:-1], "utf-8").decode("unicode_escape")
                toks.end()
                if word == "description":
                    description = value
                else:
                    source = value
            elif word == "backward":
                if rest not in ("full", "split"):
                    raise KoalaSyntaxError(f"bad backward mode {rest!r}", self.pos(line, rest_at + 1),
                                           "'full' or 'split'")
                backward = rest
            elif word == "compact":
                if rest not in COMPACT_MODES:
                    raise KoalaSyntaxError(f"bad compact mode {rest!r}", self.pos(line, rest_at + 1),
                                           " or ".join(f"'{mode}'" for mode in COMPACT_MODES))
                compact = A.CompactSpec(rest, pos=self.pos(line))
            elif word == "placement":
                placement = self._placement(line, rest_at)
            elif word == "supports":
                supports.extend(self._supports(line, rest_at))
            elif word == "let":
                lets.append(self._let(_Tokens(line, self.file)))
            else:
                rank = self._rank_header(line)
                if rank in ranks:
                    raise KoalaSyntaxError(f"second block for rank {rank if rank is not None else '(any)'}",
                                           self.pos(line))
                ranks[rank] = self._block(line)
        if not name:
            raise KoalaSyntaxError("missing 'schedule NAME' line", A.Pos(self.file, 1, 1, ""),
                                   "a first line like 'schedule my-schedule'")
        if not ranks:
            raise KoalaSyntaxError("no 'rank:' block", A.Pos(self.file, max(1, len(self.text.splitlines())), 1, ""),
                                   "a block 'rank:' with the actions of each rank")
        return A.ProgramAst(name, description, source, tuple(supports), placement, backward, tuple(lets),
                            ranks, self.file, compact)

    def _placement(self, line: Line, at: int) -> A.PlacementSpec:
        toks = _Tokens(line, self.file, at)
        if toks.cur.kind != "name":
            toks.fail("a placement: linear, interleaved, vshape, bidirectional or map")
        style = toks.next().text
        if style != "map":
            toks.end()
            return A.PlacementSpec(style, pos=toks.toks[0].pos)
        groups, cur = [], []
        while toks.cur.kind != "end":
            if toks.at("|"):
                toks.next()
                groups.append(tuple(cur))
                cur = []
                continue
            cur.append(toks.factor())
        groups.append(tuple(cur))
        if any(not g for g in groups):
            toks.fail("the rank of every stage, e.g. 'map 0 1 2 3 | 3 2 1 0'")
        return A.PlacementSpec("map", tuple(groups), pos=toks.toks[0].pos)

    def _supports(self, line: Line, at: int) -> list[A.Requirement]:
        toks = _Tokens(line, self.file, at)
        out = []
        while True:
            start = toks.cur.pos.col - line.indent - 1
            cond = toks.expr()
            stop = toks.cur.pos.col - line.indent - 1
            out.append(A.Requirement(cond, line.content[start:stop].strip(), pos=toks.toks[0].pos))
            if toks.at(","):
                toks.next()
                continue
            toks.end("',' or end of line")
            return out

    def _let(self, toks: _Tokens) -> A.Let:
        pos = toks.expect("let").pos
        if toks.cur.kind != "name" or toks.cur.text in KEYWORDS or toks.cur.text in OPS or toks.cur.text in FUNCTIONS:
            toks.fail("a variable name (not F, B, I, W or a keyword)")
        name = toks.next().text
        if name in ("p", "m", "v", "r"):
            raise KoalaSyntaxError(f"cannot rebind {name!r}", toks.toks[1].pos, "another name")
        toks.expect("=", "'='")
        value = toks.expr()
        toks.end()
        return A.Let(name, value, pos=pos)

    def _rank_header(self, line: Line) -> int | None:
        toks = _Tokens(line, self.file)
        toks.expect("rank")
        rank = None
        if toks.cur.kind == "num":
            rank = int(toks.next().text)
        toks.expect(":", "':' (or a rank number then ':')")
        toks.end("end of line after ':' (the actions go on the indented lines below)")
        if not line.children:
            raise KoalaSyntaxError("empty rank block", self.pos(line), "indented lines with actions")
        return rank

    def _block(self, parent: Line) -> tuple[A.Stmt, ...]:
        out: list[A.Stmt] = []
        children = parent.children
        i = 0
        while i < len(children):
            line = children[i]
            stmt = self._statement(line)
            if isinstance(stmt, A.If) and i + 1 < len(children) and children[i + 1].content.split(":")[0].strip() == "else":
                i += 1
                stmt = replace(stmt, orelse=self._body(children[i], "else"))
            out.append(stmt)
            i += 1
        return tuple(out)

    def _body(self, line: Line, keyword: str, toks: _Tokens | None = None) -> tuple[A.Stmt, ...]:
        """After `keyword ... :` either an inline op sequence or an indented block."""
        if toks is None:
            toks = _Tokens(line, self.file)
            toks.expect(keyword)
            toks.expect(":", "':'")
        if toks.cur.kind != "end":
            if line.children:
                raise KoalaSyntaxError("both an inline body and an indented block", self.pos(line.children[0]))
            pos = toks.cur.pos
            return (A.Seq(toks.items(), pos=pos),)
        if not line.children:
            raise KoalaSyntaxError(f"empty {keyword!r} body", toks.cur.pos, "ops after ':' or an indented block")
        return self._block(line)

    def _statement(self, line: Line) -> A.Stmt:
        toks = _Tokens(line, self.file)
        if toks.at("let"):
            if line.children:
                raise KoalaSyntaxError("unexpected indented block", self.pos(line.children[0]))
            return self._let(toks)
        if toks.at("for"):
            pos = toks.next().pos
            if toks.cur.kind != "name" or toks.cur.text in KEYWORDS or toks.cur.text in OPS:
                toks.fail("a loop variable name")
            var = toks.next().text
            toks.expect("in", "'in'")
            start = toks.arith()
            toks.expect("..", "'..' (a range is written start..stop, stop excluded)")
            stop = toks.arith()
            toks.expect(":", "':'")
            return A.For(var, start, stop, self._body(line, "for", toks), pos=pos)
        if toks.at("if"):
            pos = toks.next().pos
            cond = toks.expr()
            toks.expect(":", "':'")
            return A.If(cond, self._body(line, "if", toks), (), pos=pos)
        if toks.at("slot"):
            if line.children:
                raise KoalaSyntaxError("unexpected indented block", self.pos(line.children[0]))
            pos = toks.next().pos
            if toks.cur.kind == "end":
                toks.fail("a slot number or expression, e.g. 'slot 6 * j + r'")
            value = toks.expr()
            toks.end("end of line after the slot expression")
            return A.Slot(value, pos=pos)
        if toks.at("else"):
            toks.fail("a statement", "'else' without a matching 'if' just above")
        if toks.at("rank"):
            toks.fail("a statement", "'rank' blocks go at the top level, not indented")
        if line.children:
            raise KoalaSyntaxError("unexpected indented block", self.pos(line.children[0]))
        pos = toks.cur.pos
        items = toks.items()
        toks.end("an op (F, B, I, W), '(' or '*'")
        return A.Seq(items, pos=pos)


def parse(text: str, file: str = "<string>") -> A.ProgramAst:
    """Parse `.koala` source text. Raises `KoalaSyntaxError` and nothing else."""
    try:
        return Parser(text, file).parse()
    except KoalaSyntaxError:
        raise
    except RecursionError:
        raise KoalaSyntaxError("expression nested too deeply", A.Pos(file, 1, 1, "")) from None
