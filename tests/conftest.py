"""Shared fixtures: paths to the real tokenizers and corpora in ../shared/data."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED_DATA = REPO.parent / "shared" / "data"
TOKENIZERS = SHARED_DATA / "tokenizers"
CORPORA = SHARED_DATA / "corpora"
WIKI = sorted((CORPORA / "wiki").glob("wiki-*.jsonl.gz"))

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cloud_fixtures import *  # noqa: E402, F403 - GCS and Azure emulators, a fake Hub, a fault proxy
from remote_fixtures import *  # noqa: E402, F403 - fixtures for real HTTP and S3 servers on 127.0.0.1

# Keep tokenizer threads from oversubscribing the 2-core CI machine inside test processes.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def gpt2_json() -> Path:
    return TOKENIZERS / "gpt2.json"


@pytest.fixture(scope="session")
def llama_json() -> Path:
    return TOKENIZERS / "openllama.json"


@pytest.fixture(scope="session")
def neox_json() -> Path:
    return TOKENIZERS / "gpt-neox-20b.json"


@pytest.fixture(scope="session")
def wiki_files() -> list[Path]:
    return WIKI


@pytest.fixture(scope="session")
def shakespeare() -> Path:
    return CORPORA / "tinyshakespeare.txt"


@pytest.fixture(scope="session")
def wikitext() -> Path:
    return CORPORA / "wikitext-2-valid.txt"


#: what the session's servers put in the environment (their fixtures install it once, for every
#: later test): a test that leaves one of them changed breaks the tests after it, far from itself
SESSION_ENVIRONMENT = (
    "STORAGE_EMULATOR_HOST",
    "AWS_ENDPOINT_URL",
    "AWS_ACCESS_KEY_ID",
    "AZURE_STORAGE_CONNECTION_STRING",
    "HF_ENDPOINT",
)


@pytest.fixture(autouse=True)
def _session_environment_kept(request):
    """Fail the test that changed a variable a session fixture had set, naming it (a lazily
    started server may set one during the test: only what was set before is watched)."""
    before = {k: os.environ[k] for k in SESSION_ENVIRONMENT if k in os.environ}
    yield
    changed = sorted(k for k, v in before.items() if os.environ.get(k) != v)
    assert not changed, f"{request.node.nodeid} left the session's {', '.join(changed)} changed"


#: the cases of the whole suite that take longest (5 s and more each on the 2-core VM): marked
#: ``slow``, so that ``tools/test.sh -m "not slow"`` is the quick suite; CI runs them too.
#: A name here that matches no test of a collected file fails the run (a renamed test would
#: quietly join the quick suite otherwise).
SLOW_TESTS = frozenset(
    {
        "test_accelerate.py::test_accelerate_two_processes_each_document_once_and_resume_exact",
        "test_batch_digests.py::test_every_batch_is_bit_identical_to_the_recorded_digests",
        "test_cli_manners.py::test_ctrl_c_during_pack_exits_130_and_prints_the_resume_command",
        "test_cli_manners.py::test_json_output_parses",
        "test_cli_tools.py::test_info_summarises_the_index",
        "test_cloud.py::test_every_scheme_reads_every_document_once_in_the_local_order",
        "test_cloud.py::test_info_verify_head_on_read_only_schemes",
        "test_cloud.py::test_merge_copies_server_side",
        "test_cloud.py::test_merge_copy_refuses_a_corrupt_shard_on_s3",
        "test_cloud.py::test_pack_verify_load_round_trip",
        "test_cloud.py::test_url_password_is_basic_auth_and_never_shown",
        "test_cluster_datatrove.py::test_datatrove_pipeline_packs_exactly_the_filtered_documents",
        "test_cluster_imports.py::test_cli_packer_and_loader_import_neither_ray_nor_datatrove",
        "test_cluster_partitions.py::test_spark_and_dask_partitions_merge_into_the_local_pack",
        "test_cluster_ray.py::test_a_killed_write_task_is_retried_without_duplicates_or_orphans",
        "test_cluster_ray.py::test_a_rerun_with_another_number_of_blocks_is_refused_by_name_and_packs_nothing_twice",
        "test_cluster_ray.py::test_ray_pack_equals_a_local_pack",
        "test_distributed.py::test_torchrun_elastic_three_ranks_to_two",
        "test_distributed.py::test_torchrun_exactly_once_without_equal_batches",
        "test_distributed.py::test_torchrun_killed_and_resumed_equals_uninterrupted",
        "test_distributed.py::test_torchrun_three_ranks_two_workers_each",
        "test_docs_run.py::test_every_code_block_of_the_page_runs",
        "test_hf.py::test_trainer_two_ranks_each_document_once_and_resume_exact",
        "test_hostile_compressed.py::test_skip_keeps_every_document_decompressed_before_the_break_in_pack_count_and_loader",
        "test_integration_messages.py::test_multi_gpu_launch_on_cpus_names_accelerator_cpu_true",
        "test_lightning.py::test_mid_epoch_checkpoint_resumes_exactly",
        "test_mixture_raw.py::test_realized_quotas_and_raw_documents",
        "test_mixtures.py::test_exactly_once_within_the_quota_for_any_layout",
        "test_mixtures.py::test_torchrun_three_ranks_two_workers_a_mixture_file",
        "test_nccl.py::test_the_same_collectives_over_gloo_at_world_size_1",
        "test_observe_export.py::test_hf_callback_adds_the_figures_to_each_log",
        "test_observe_export.py::test_lightning_callback_logs_through_the_trainers_logger",
        "test_observe_stores.py::test_a_throttled_store_shows_in_the_wait_the_stages_and_the_store",
        "test_observe_wait.py::test_reduction_over_two_gloo_ranks_names_the_rank_that_waited",
        "test_hostile_shutdown.py::test_an_interpreter_that_exits_holding_live_iterators_prints_nothing",
        "test_observe_watchdog.py::test_a_stopped_worker_is_named_and_every_stack_logged",
        "test_observe_watchdog.py::test_close_after_watchdog_raise_leaves_no_stopped_worker",
        "test_observe_watchdog.py::test_watchdog_raise_stops_the_run_with_a_named_error",
        "test_observe_watchdog.py::test_without_workers_the_warning_holds_the_readers_own_stack",
        "test_pack_columnar.py::test_struct_field_and_where_give_the_same_documents_from_every_kind_of_input",
        "test_pack_determinism.py::test_paragraph_split_is_independent_of_chunking",
        "test_pack_errors.py::test_a_damaged_compressed_file_keeps_what_came_before_whatever_the_chunking",
        "test_pack_part.py::test_parts_of_input_files_merge_into_the_local_pack",
        "test_pack_remote_inputs.py::test_a_killed_pack_of_remote_parquet_resumes_byte_identically_unless_the_input_changed",
        "test_pack_remote_inputs.py::test_a_remote_object_cut_short_is_named_by_url_and_line",
        "test_pack_remote_inputs.py::test_the_issues_example_hf_glob_packed_into_s3_by_the_cli",
        "test_pack_resume.py::test_docs_mode_resume_after_kill_equals_uninterrupted",
        "test_pack_resume.py::test_packed_mode_resume_after_kill_equals_uninterrupted",
        "test_pack_resume.py::test_parquet_resume_after_a_kill_at_a_random_point_equals_uninterrupted",
        "test_pack_resume.py::test_skip_mode_resume_counts_each_skip_once",
        "test_pack_tasks.py::test_eight_tasks_over_three_files_merge_to_the_single_task_pack",
        "test_pack_tasks.py::test_merge_on_s3_in_place",
        "test_parallel_example.py::test_tp_and_cp_layouts_train_each_dp_rank_on_the_same_batches",
        "test_parallel_layouts.py::test_a_peer_with_another_seed_fails_at_construction",
        "test_parallel_layouts.py::test_a_first_stage_that_fails_tells_its_middle_stage",
        "test_parallel_layouts.py::test_a_reader_that_fails_tells_its_receivers",
        "test_parallel_layouts.py::test_broadcast_over_http_reads_the_shard_bytes_of_the_dp_ranks_alone",
        "test_parallel_layouts.py::test_dp2_cp2_context_peers_hold_the_two_halves_of_one_batch",
        "test_parallel_layouts.py::test_dp2_tp2_tensor_peers_share_every_batch_and_dp_ranks_split_the_epoch",
        "test_parallel_layouts.py::test_dp2_tp2_saved_mid_epoch_resumes_as_dp4_with_every_document_once",
        "test_parallel_layouts.py::test_dp2_tp2_cp2_on_eight_processes",
        "test_parallel_layouts.py::test_pp2_dp2_first_stage_gets_inputs_last_gets_labels",
        "test_parallel_layouts.py::test_pp3_dp2_middle_stages_read_nothing_and_step_with_the_others",
        "test_parallel_layouts.py::test_replica_peers_agree_in_every_batching_mode_a_mixture_and_raw_text",
        "test_rank_pieces.py::test_ranks_differ_by_at_most_one_piece_and_each_ends_with_one_short_batch",
        "test_raw.py::test_bad_lines_are_named_or_skipped_and_counted",
        "test_raw.py::test_resume_is_exact_and_does_not_tokenize_again",
        "test_raw.py::test_resume_without_counts_reads_again_and_is_exact",
        "test_raw.py::test_torchrun_two_ranks_raw_text_with_counts",
        "test_raw_pinned.py::test_a_listing_and_an_answer_give_one_version",
        "test_remote_loader.py::test_cli_reads_http_and_s3_datasets",
        "test_remote_loader.py::test_pack_to_s3_then_stream_exactly_once_over_ranks_and_workers",
        "test_remote_pack.py::test_pack_killed_at_any_point_then_resumed_equals_an_uninterrupted_pack",
        "test_remote_pack.py::test_pack_killed_from_outside_mid_run_then_resumed",
        "test_remote_pack.py::test_resume_of_a_complete_s3_pack_is_refused",
        "test_scale.py::test_a_format_3_and_a_format_4_part_merge_into_format_4_with_shards_npy",
        "test_shuffle_ddp.py::test_one_shard_under_ddp_reshuffles_ranks_and_resumes_exactly",
        "test_torchtitan.py::test_dp2_tp2_and_dp2_cp2_checkpoint_through_torchtitan_and_resume_exactly_also_as_dp4",
        "test_online_mixing_example.py::test_weights_change_and_a_resumed_run_equals_the_uninterrupted_one",
        "test_steering_ranks.py::test_two_ranks_take_the_same_change_and_refuse_a_different_one",
        "test_train_ddp.py::test_every_rank_takes_the_steps_on_disjoint_rows",
        "test_train_ddp.py::test_resume_equals_uninterrupted",
    }
)


def pytest_collection_modifyitems(config, items):
    seen = set()
    files = set()
    for item in items:
        path = item.nodeid.split("::", 1)[0].removeprefix("tests/")
        files.add(path)
        name = f"{path}::{item.originalname}"
        if name in SLOW_TESTS:
            seen.add(name)
            item.add_marker(pytest.mark.slow)
    missing = sorted(n for n in SLOW_TESTS - seen if n.split("::", 1)[0] in files and not config.option.keyword)
    if missing and not config.option.markexpr:
        raise pytest.UsageError(f"conftest.SLOW_TESTS names tests that do not exist: {', '.join(missing)}")
