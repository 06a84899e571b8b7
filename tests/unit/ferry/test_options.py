"""Each service's options are one dataclass (base/options.py): a field is its flag, with help, default and choices,
the options the flag parses into, and the argv `ferry up` starts the service with."""
from __future__ import annotations

import argparse
from dataclasses import make_dataclass, replace

import pytest

import ferry.launcher
import router.__main__
import scheduler.__main__
from base.config import EngineConfig
from base.options import DefaultsHelpFormatter, add_arguments, from_args, option, to_argv
from ferry.cli import build_parser as ferry_parser
from router.options import RouterOptions
from scheduler.options import ServeOptions


def up_parser() -> argparse.ArgumentParser:
    sub = next(a for a in ferry_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["up"]


PARSERS = {"python -m scheduler": scheduler.__main__.build_parser, "python -m router": router.__main__.argument_parser,
           "ferry up": up_parser}


def with_field(options_type: type, name: str, default, help: str, **metadata) -> type:
    """A copy of options_type with one more field: what adding an option to it is."""
    return make_dataclass(options_type.__name__, [(name, type(default), option(default, help, **metadata))],
                          bases=(options_type,))


def parsed(options_type: type, argv: list[str]):
    parser = argparse.ArgumentParser()
    add_arguments(parser, options_type)
    return from_args(options_type, parser.parse_args(argv))


@pytest.mark.parametrize("options_type", [EngineConfig, ServeOptions, RouterOptions])
def test_a_new_field_is_a_flag_with_its_help_default_and_choices_and_round_trips_through_argv(options_type):
    extended = with_field(options_type, "warmup_mode", "none", "how the service warms up", choices=("none", "full"))
    parser = argparse.ArgumentParser(formatter_class=DefaultsHelpFormatter)
    add_arguments(parser, extended)
    text = " ".join(parser.format_help().split())
    assert "--warmup-mode {none,full}" in text and "how the service warms up (default: none)" in text
    assert parsed(extended, []).warmup_mode == "none"
    options = parsed(extended, ["--warmup-mode", "full"])
    assert options.warmup_mode == "full"
    assert "--warmup-mode" in to_argv(options) and parsed(extended, to_argv(options)) == options
    with pytest.raises(SystemExit):
        parser.parse_args(["--warmup-mode", "half"])


def test_every_field_round_trips_through_the_argv_that_starts_a_service():
    serve = ServeOptions(host="0.0.0.0", port=7001, advertise_host="10.0.0.5", redis_url="redis://r:6379",
                         scheduler_id="s1", heartbeat_ttl=1.5, metrics_port=9100, log_stats_interval=0.0,
                         drain_timeout=5.0, limits=replace(ServeOptions().limits, max_queued_requests=7))
    assert parsed(ServeOptions, to_argv(serve)) == serve
    routing = RouterOptions(schedulers=["127.0.0.1:1", "127.0.0.1:2"], policy="round_robin", http_port=0,
                            workers=2, tool_call_parser="hermes",
                            retry=replace(RouterOptions().retry, max_attempts=5),
                            key_limits=replace(RouterOptions().key_limits, tokens_per_minute=600))
    assert parsed(RouterOptions, to_argv(routing)) == routing
    config = EngineConfig(dtype="float32", device="cpu", enable_prefix_caching=False, enforce_eager=True, seed=3)
    assert parsed(EngineConfig, to_argv(config)) == config
    assert to_argv(RouterOptions()) == [] and to_argv(EngineConfig()) == []   # defaults: nothing to pass


def test_ferry_up_passes_a_new_scheduler_and_router_field_through_to_the_services(monkeypatch):
    serve_type = with_field(ServeOptions, "warmup_requests", 0, "requests to run before registering")
    router_type = with_field(RouterOptions, "sticky_sessions", 0, "seconds a session keeps its scheduler")
    monkeypatch.setattr(ferry.launcher, "ServeOptions", serve_type)
    monkeypatch.setattr(ferry.launcher, "RouterOptions", router_type)
    monkeypatch.setattr(scheduler.__main__, "ServeOptions", serve_type)
    monkeypatch.setattr(router.__main__, "RouterOptions", router_type)
    args = ferry_parser().parse_args(["up", "--warmup-requests", "4", "--sticky-sessions", "30", "--heartbeat-ttl",
                                      "2.5", "--max-tokens-per-minute-per-key", "900", "--num-routers", "2"])

    scheduler_argv = to_argv(ferry.launcher.scheduler_options(args, 7001, "redis://r:6379", 1))
    served = from_args(serve_type, scheduler.__main__.build_parser().parse_args(scheduler_argv))
    assert (served.warmup_requests, served.heartbeat_ttl, served.port, served.redis_url) == (4, 2.5, 7001,
                                                                                             "redis://r:6379")
    router_argv = to_argv(ferry.launcher.router_options(args, "redis://r:6379", "/models/m", [7001, 7002]))
    routing = from_args(router_type, router.__main__.argument_parser().parse_args(router_argv))
    assert routing.sticky_sessions == 30 and routing.key_limits.tokens_per_minute == 900 and routing.workers == 2
    assert routing.schedulers == ["127.0.0.1:7001", "127.0.0.1:7002"] and routing.model_path == "/models/m"


def test_ferry_up_sets_the_scheduler_host_itself_not_from_the_routers_host():
    args = ferry_parser().parse_args(["up", "--host", "0.0.0.0", "--metrics-port", "9100"])
    options = ferry.launcher.scheduler_options(args, 7001, "redis://r:6379", 2)
    assert options.host == "127.0.0.1" and options.metrics_port == 9102
    assert ferry.launcher.router_options(args, "redis://r:6379", "/m", [7001]).http_host == "0.0.0.0"


@pytest.mark.parametrize("name", PARSERS)
def test_every_flag_has_help_and_shows_its_default_and_its_choices(name: str):
    parser = PARSERS[name]()
    formatter = DefaultsHelpFormatter(parser.prog)
    shown = [action for action in parser._actions if action.help != argparse.SUPPRESS
             and not isinstance(action, argparse._HelpAction)]
    assert len(shown) > 30
    for action in shown:
        flag = action.option_strings[0]
        assert action.help, f"{name} {flag} has no help text"
        assert "default:" in formatter._get_help_string(action), f"{name} {flag} does not show its default"
    help_text = parser.format_help()
    for action in shown:
        if action.choices:
            assert "{" + ",".join(map(str, action.choices)) + "}" in help_text
    with_choices = {flag for action in shown if action.choices for flag in action.option_strings}
    expected = {"python -m scheduler": {"--dtype", "--device", "--attention-backend", "--log-level"},
                "python -m router": {"--policy", "--tool-call-parser", "--log-level"},
                "ferry up": {"--dtype", "--device", "--attention-backend", "--policy"}}[name]
    assert expected <= with_choices


def test_the_help_names_the_variable_behind_a_default_never_its_value(monkeypatch):
    monkeypatch.setenv("FERRY_REDIS_URL", "redis://:hunter2@redis:6379")
    parser = scheduler.__main__.build_parser()
    assert parser.parse_args([]).redis_url == "redis://:hunter2@redis:6379"
    assert "$FERRY_REDIS_URL" in parser.format_help() and "hunter2" not in parser.format_help()
