"""``titan-plugins``: list, report, doctor, env and plan."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from typing import Any

from titan_plugins import activation, report
from titan_plugins.doctor import FAIL, OK, WARN, Check, core_checks


def _activate(import_targets: bool) -> activation.Activation:
    state = activation.apply()
    if import_targets and state.engine is not None:
        for name in sorted(state.engine.pending_modules()):
            try:
                importlib.import_module(name)
            except Exception as err:  # report, never crash the CLI
                for patch in state.engine.patches():
                    if patch.module == name and patch.status == "pending":
                        patch.set_status(
                            "skipped" if patch.optional else "failed",
                            f"import {name} failed: {type(err).__name__}: {err}",
                        )
    return state


def _print_list(data: dict[str, Any], out: Any) -> None:
    print(
        f"titan-plugins {data['core_version']}  active: {data['active']}"
        f"  channel: {data['channel']}  autoload here: {data['autoload']['state']}",
        file=out,
    )
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
    if state.manager is not None:
        for record in state.manager.records.values():
            if record.state == "failed":
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
            if patch.status == "failed":
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
    worst = FAIL if any(c.status == FAIL for _, c in checks) else OK
    if as_json:
        print(json.dumps([{"plugin": p, **c.as_dict()} for p, c in checks], indent=2))
    else:
        marks = {OK: "ok  ", WARN: "WARN", FAIL: "FAIL"}
        for plugin, check in checks:
            print(
                f"[{marks.get(check.status, check.status)}] {plugin}: {check.name}: {check.detail}"
            )
            if check.fix and check.status != OK:
                print(f"       fix: {check.fix}")
    return 1 if worst == FAIL else 0


def _env() -> int:
    state = _activate(import_targets=False)
    rows: list[tuple[str, Any]] = []
    if state.manager is not None:
        for impl in state.manager.hook.titan_settings.get_hookimpls():
            try:
                rows.extend((impl.plugin_name, s) for s in impl.function() or [])
            except Exception as err:
                print(f"{impl.plugin_name}: titan_settings raised {err}", file=sys.stderr)
    else:
        from titan_plugins.switches import CORE_SETTINGS

        rows = [("titan-core", s) for s in CORE_SETTINGS]
    known = {s.var for _, s in rows}
    for plugin, setting in rows:
        current = os.environ.get(setting.var)
        shown = "(unset)" if current is None else repr(current)
        choices = f" [{'|'.join(setting.choices)}]" if setting.choices else ""
        print(
            f"{setting.var}={shown}  default {setting.default!r}{choices}  ({plugin})\n    {setting.doc}"
        )
    unknown = sorted(v for v in os.environ if v.startswith("TITAN_") and v not in known)
    if state.manager is not None:
        from titan_plugins.switches import plugin_switch_var

        unknown = [
            v for v in unknown if v not in {plugin_switch_var(n) for n in state.manager.records}
        ]
    for var in unknown:
        print(f"warning: {var} is set but no installed plugin declares it (typo?)")
    return 0


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
    sub.add_parser("env", help="every switch, documented, with its current value")
    sub.add_parser("plan", help="per-rank memory and FLOPs of a Megatron layout", add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command == "plan":
        from titan_plugins.plan.cli import main as plan_main

        return plan_main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "list":
        _print_list(report.collect(_activate(args.import_targets)), sys.stdout)
        return 0
    if args.command == "report":
        print(json.dumps(report.collect(_activate(args.import_targets)), indent=2, default=str))
        return 0
    if args.command == "doctor":
        return _doctor(args.json, not args.no_import)
    return _env()


if __name__ == "__main__":
    sys.exit(main())
