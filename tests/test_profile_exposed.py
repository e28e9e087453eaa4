"""The decode profile's exposed time: each kernel's share of the busy span when PDL makes durations overlap."""
from benchmarks.profile_decode import exposed_time


def test_overlapping_launches_count_only_the_time_they_add_and_shares_sum_to_the_busy_span():
    events = [("matmul", 0.0, 10.0),     # 0-10
              ("decode", 5.0, 10.0),     # waits under PDL from 5; adds 10-15
              ("norm", 20.0, 2.0),       # after an idle gap of 5: adds its whole 2
              ("decode", 20.5, 0.5),     # inside norm's span: adds nothing
              ("matmul", 21.0, 4.0)]     # adds 22-25
    exposed = exposed_time(events)
    assert exposed == {"matmul": 13.0, "decode": 5.0, "norm": 2.0}
    assert sum(exposed.values()) == 25.0 - 5.0   # span minus the idle gap
