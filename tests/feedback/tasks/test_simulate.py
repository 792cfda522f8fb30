"""`reflow simulate`'s users through a real gateway and worker: what they ask is answered and what
they rate reaches the gateway, even while their tenant's quota refuses them for a while."""

from __future__ import annotations

from feedback.tasks import get_task
from feedback.tasks.simulate import simulate
from reflow.settings import Settings
from tests.support.stack import start_stack, stop_stack

# one comes back every 15 s: the users' ratings are refused if they are sent within 15 s of their
# last question, which on the busiest machine takes a few (the built-in model answers in tens of ms)
REQUESTS_PER_MINUTE = 4


async def test_ratings_a_spent_quota_refuses_are_sent_again_once_it_refills(settings: Settings) -> None:
    # the users' questions spend the tenant's requests, so the stream of their ratings that follows
    # is refused (SubmitFeedback takes a request as Generate does) until one comes back
    stack = await start_stack(settings, max_concurrent_streams=0, requests_per_minute=REQUESTS_PER_MINUTE)
    try:
        report = await simulate(
            stack.address,
            stack.api_key,
            task=get_task("arith"),
            rate=REQUESTS_PER_MINUTE * 4,
            duration_s=0.25,
        )
        refusals = stack.metrics.registry.get_sample_value(
            "reflow_gateway_quota_refusals_total", {"quota": "requests_per_minute"}
        )
    finally:
        await stop_stack(stack)
    assert refusals is not None and refusals >= 1
    assert (report.requests, report.finished) == (REQUESTS_PER_MINUTE, REQUESTS_PER_MINUTE)
    assert not report.errors and not report.feedback_errors, report
    assert report.rated == REQUESTS_PER_MINUTE
