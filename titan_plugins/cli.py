"""``titan-plugins``: list, report, doctor, env and plan."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from typing import Any

from titan_plugins import activation, namespace, report, settings
from titan_plugins.doctor import FAIL, OK, WARN, Check, core_checks, import_checks
from titan_plugins.import_replay import DEFAULT_TIMEOUT_S as DEFAULT_IMPORT_TIMEOUT_S
from titan_plugins.patching import FAILED, SKIPPED


def _activate(import_targets: bool) -> activation.Activation:
    """Activate collecting every problem (never raising, STRICT or not), so the commands can
    show the whole diagnosis; :func:`_strict_exit` turns problems into the exit status."""
    with settings.strictness(False):
        try:
            state = activation.apply(strict=False)
        except Exception as err:  # report, never crash the CLI
            state = activation.current() or activation.Activation("apply")
            state.state, state.detail = activation.FAILED, f"{type(err).__name__}: {err}"
            return state
        if import_targets and state.engine is not None:
            # a target's module may print or set up logging on stdout at import (miles' modules
            # log to the root logger, configured for stdout): keep the command's own output,
            # JSON included, to itself
            with contextlib.redirect_stdout(sys.stderr):
                state.engine.import_pending()
    return state


def _strict_problems(state: activation.Activation) -> list[str]:
    """What TITAN_PLUGINS_STRICT=1 would have stopped on: bad values, failed plugins/patches."""
    found = list(state.problems) + list(state.errors)
    if state.state == activation.FAILED:
        found.append(f"activation failed: {state.detail}")
    for patch in state.engine.patches() if state.engine else []:
        if patch.status == FAILED or (patch.status == SKIPPED and not patch.optional):
            found.append(f"patch {patch.id}: {patch.status}: {patch.detail}")
    return found


def _strict_exit(state: activation.Activation) -> int:
    """Exit status: 1 under STRICT when something is wrong (printed to stderr), else 0."""
    if not settings.strict():
        return 0
    found = _strict_problems(state)
    for problem in found:
        print(f"error: {problem}", file=sys.stderr)
    if found:
        print(f"error: {settings.strict_reason()}, and the problems above", file=sys.stderr)
    return 1 if found else 0


def _print_list(data: dict[str, Any], out: Any) -> None:
    print(
        f"titan-plugins {data['core_version']}  active: {data['active']}"
        f"  channel: {data['channel']}  autoload here: {data['autoload']['state']}",
        file=out,
    )
    print(f"  megatron: {data['megatron']['summary']}", file=out)
    for name, host in data.get("hosts", {}).items():
        print(f"  {name}: {host['summary']}", file=out)
    if not data["active"]:
        print(f"  inactive: {data['inactive_reason']}", file=out)
    if not data["plugins"]:
        print("  no plugins installed (entry-point group titan_plugins)", file=out)
    for plugin in data["plugins"]:
        why = f" ({plugin['reason']})" if plugin["reason"] else ""
        print(
            f"- {plugin['name']}  [{plugin['distribution']} {plugin['version']}]  "
            f"{plugin['state']}{why}",
            file=out,
        )
        if plugin["hooks"]:
            print(f"    hooks: {', '.join(plugin['hooks'])}", file=out)
        for patch in plugin["patches"]:
            detail = f" ({patch['detail']})" if patch["detail"] else ""
            print(
                f"    patch {patch['id']} -> {patch['target']}: {patch['status']}{detail}", file=out
            )
        for key, value in (plugin.get("report") or {}).items():
            print(f"    {key}: {value}", file=out)


def _doctor(as_json: bool, import_targets: bool) -> int:
    state = _activate(import_targets)
    checks: list[tuple[str, Check]] = [
        ("core", c) for c in core_checks(activation.autoload_state())
    ]
    checks.extend(
        ("core", Check("setting", FAIL, problem, "fix the value or unset the variable"))
        for problem in state.problems
    )
    if state.state == activation.FAILED:
        checks.append(("core", Check("activation", FAIL, state.detail, "see the message above")))
    if state.manager is not None:
        for record in state.manager.records.values():
            if record.state == FAILED:  # a plugin that did not load
                checks.append(
                    (record.name, Check("load", FAIL, record.reason, "fix or uninstall the plugin"))
                )
        for impl in state.manager.hook.titan_doctor.get_hookimpls():
            try:
                found = impl.function() or []
            except Exception as err:
                found = [Check("doctor", FAIL, f"titan_doctor raised {err}", "report a plugin bug")]
            checks.extend((impl.plugin_name, c) for c in found)
        for patch in state.engine.patches() if state.engine else []:
            if patch.status == FAILED:
                checks.append(
                    (
                        patch.plugin,
                        Check(
                            patch.id,
                            FAIL,
                            patch.detail,
                            "see the plugin README (supported Megatron range)",
                        ),
                    )
                )
    _print_checks(checks, as_json)
    worst = FAIL if any(c.status == FAIL for _, c in checks) else OK
    return 1 if worst == FAIL or _strict_exit(state) else 0


def _print_checks(checks: list[tuple[str, Check]], as_json: bool) -> None:
    if as_json:
        print(json.dumps([{"plugin": p, **c.as_dict()} for p, c in checks], indent=2))
        return
    marks = {OK: "ok  ", WARN: "WARN", FAIL: "FAIL"}
    for plugin, check in checks:
        print(f"[{marks.get(check.status, check.status)}] {plugin}: {check.name}: {check.detail}")
        if check.fix and check.status != OK:
            print(f"       fix: {check.fix}")


def _doctor_imports(as_json: bool, timeout_s: float) -> int:
    """``doctor --imports``: nothing is imported in this process (the plugin that ends the
    process would end the doctor too); each plugin is imported alone in a child."""
    checks, summary = import_checks(timeout_s)
    _print_checks(checks, as_json)
    if not as_json:
        print(summary)
    return 1 if any(c.status == FAIL for _, c in checks) else 0


def _seconds(text: str) -> float:
    """A positive number of seconds, for argparse (its message names the option)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds, e.g. 60")
    return value


def _declared(state: activation.Activation) -> list[tuple[str, settings.Setting]]:
    """(owner, Setting) for every switch and knob the core and the installed plugins declare,
    plugins switched on or off: a knob is never "a typo" because its plugin is off or because
    the activation failed (it used to be, when the knobs came from the activation's manager)."""
    from titan_plugins import manager
    from titan_plugins.switches import CORE_SETTINGS, plugin_switch

    records = state.manager.records if state.manager is not None else {}
    off = {name for name, record in records.items() if record.state == manager.DISABLED}
    managers = [state.manager] if state.manager is not None else []
    try:  # the switched-off plugins (all of them without a manager), loaded only to ask
        rest = [ep for ep in manager.discover() if ep.name in off or not managers]
        if rest:
            managers.append(manager.get_plugin_manager(entry_points=rest, switches=False))
    except Exception as err:  # the listing goes on with what is known
        print(f"error: the switched-off plugins could not be listed: {err!r}", file=sys.stderr)
    rows: list[tuple[str, settings.Setting]] = [("titan-core", s) for s in CORE_SETTINGS]
    for pm in managers:
        for name in pm.records:
            if "@" not in name:  # refused duplicates have no switch of their own
                rows.append((name, plugin_switch(name)))
        for impl in pm.hook.titan_settings.get_hookimpls():
            if impl.plugin_name == manager.BUILTIN:
                continue  # listed above, also when nothing is active
            try:
                declared = list(impl.function() or [])
            except Exception as err:
                print(f"{impl.plugin_name}: titan_settings raised {err}", file=sys.stderr)
                continue
            rows.extend((impl.plugin_name, s) for s in declared if isinstance(s, settings.Setting))
    first: dict[str, tuple[str, settings.Setting]] = {}
    for owner, setting in rows:
        first.setdefault(setting.name, (owner, setting))
    return list(first.values())


def _env() -> int:
    state = _activate(import_targets=False)
    rows = _declared(state)
    records = getattr(state.manager, "records", {})
    for plugin, setting in rows:
        current = os.environ.get(setting.name)
        shown = "(unset)" if current is None else settings.shown_value(current)
        record = records.get(plugin)
        owner = f"{plugin}; {record.state}: {record.reason}" if record and record.reason else plugin
        print(
            f"{setting.name}={shown}  default {setting.shown_default()}  "
            f"[{setting.accepted()}]  ({owner})\n    {setting.doc}"
        )
        problem = settings.problems([setting])
        if problem:
            print(f"    error: {problem[0]}")
    for problem in namespace.unknown_variables(s.name for _, s in rows):
        print(f"warning: {problem}")
    return _strict_exit(state)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``titan-plugins`` command."""
    parser = argparse.ArgumentParser(prog="titan-plugins", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p_list = sub.add_parser("list", help="installed plugins, enabled or why not, hooks, patches")
    p_list.add_argument(
        "--import-targets", action="store_true", help="import patch targets to show applied/failed"
    )
    p_report = sub.add_parser("report", help="the same as JSON")
    p_report.add_argument("--json", action="store_true", default=True)
    p_report.add_argument("--import-targets", action="store_true")
    p_doctor = sub.add_parser("doctor", help="environment and capability checks with fixes")
    p_doctor.add_argument("--json", action="store_true")
    p_doctor.add_argument("--no-import", action="store_true", help="do not import megatron targets")
    p_doctor.add_argument(
        "--imports",
        action="store_true",
        help="only import each plugin alone, each in its own process, and name one whose import "
        "ends the process or hangs",
    )
    p_doctor.add_argument(
        "--import-timeout",
        type=_seconds,
        default=None,
        metavar="S",
        help="with --imports: a plugin still importing after S seconds hangs (default "
        f"{DEFAULT_IMPORT_TIMEOUT_S:g})",
    )
    sub.add_parser("env", help="every switch, documented, with its current value")
    sub.add_parser("plan", help="per-rank memory and FLOPs of a Megatron layout", add_help=False)
    sub.add_parser(
        "verify", help="train with each plugin off / alone / all on and judge it", add_help=False
    )
    args, rest = parser.parse_known_args(argv)
    if args.command == "plan":
        from titan_plugins.plan.cli import main as plan_main

        return plan_main(rest)
    if args.command == "verify":
        from titan_plugins.verify.cli import main as verify_main

        return verify_main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "list":
        state = _activate(args.import_targets)
        _print_list(report.collect(state), sys.stdout)
        return _strict_exit(state)
    if args.command == "report":
        state = _activate(args.import_targets)
        print(json.dumps(report.collect(state), indent=2, default=str))
        return _strict_exit(state)
    if args.command == "doctor":
        if args.import_timeout is not None and not args.imports:
            parser.error("--import-timeout applies to doctor --imports: add --imports")
        if args.imports:
            return _doctor_imports(args.json, args.import_timeout or DEFAULT_IMPORT_TIMEOUT_S)
        return _doctor(args.json, not args.no_import)
    return _env()


def run() -> int:
    """Console-script entry point: :func:`main`, quiet when the reader of a pipe goes away."""
    try:
        return main()
    except BrokenPipeError:  # `titan-plugins env | head`
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
