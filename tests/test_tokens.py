from sgl_reason.tokens import find_new_tokens, find_tokens


def test_a_run_is_found_on_ids_not_on_text():
    assert find_tokens([5, 7, 9, 7, 9], [7, 9]) == 1
    assert find_tokens([5, 7, 9, 7, 9], [7, 9], start=2) == 3
    assert find_tokens([5, 7, 8], [7, 9]) == -1
    assert find_tokens([7], [7, 9]) == -1  # a run cut by the end of the output is not there


def test_a_run_split_across_two_calls_is_found_once_it_completes():
    out, scanned = [1, 2, 7], 0
    at, scanned = find_new_tokens(out, [7, 9], scanned)
    assert (at, scanned) == (-1, 3)
    out += [9, 4, 4]  # three ids arrive together: the run is no longer the last thing
    at, scanned = find_new_tokens(out, [7, 9], scanned)
    assert (at, scanned) == (2, 6)


def test_the_next_search_starts_where_the_last_could_not_have_matched():
    out = [7, 9, 0, 0]
    _, scanned = find_new_tokens(out, [7, 9], 0)
    assert find_new_tokens(out + [1], [7, 9], scanned) == (-1, 5)  # the old run is not re-found
