"""Shared fixtures: paths to the real tokenizers and corpora in ../shared/data."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED_DATA = REPO.parent / "shared" / "data"
TOKENIZERS = SHARED_DATA / "tokenizers"
CORPORA = SHARED_DATA / "corpora"
WIKI = sorted((CORPORA / "wiki").glob("wiki-*.jsonl.gz"))

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pack_helpers  # noqa: E402
from cloud_fixtures import *  # noqa: E402, F403 - GCS and Azure emulators, a fake Hub, a fault proxy
from remote_fixtures import *  # noqa: E402, F403 - fixtures for real HTTP and S3 servers on 127.0.0.1

# Keep tokenizer threads from oversubscribing the 2-core CI machine inside test processes.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_configure(config):
    """The run's directory of cached packs (pack_helpers.cached): made by the process that starts
    the run, before its xdist workers, which inherit the variable and share the packs."""
    if not hasattr(config, "workerinput") and not os.environ.get(pack_helpers.RUN_DIR_VARIABLE):
        os.environ[pack_helpers.RUN_DIR_VARIABLE] = tempfile.mkdtemp(prefix="wdsllm-run-")
        config.add_cleanup(_remove_run_dir)


def _remove_run_dir():
    shutil.rmtree(os.environ.pop(pack_helpers.RUN_DIR_VARIABLE), ignore_errors=True)


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


#: the cases of the whole suite that take longest (2 s and more each on a quiet 2-core machine):
#: marked ``slow``, so that ``tools/test.sh --quick`` (``-m "not slow"``) is the quick suite; CI
#: runs them too. A name is a test (every case of it) or one case, ``name[id]``, where the other
#: cases of a test stay quick. A name here that matches no test of a collected file fails the run
#: (a renamed test would quietly join the quick suite otherwise).
SLOW_TESTS = frozenset(
    {
        "test_accelerate.py::test_accelerate_two_processes_each_document_once_and_resume_exact",
        "test_batch_digests.py::test_every_batch_is_bit_identical_to_the_recorded_digests",
        "test_cli_answers.py::test_a_resumed_pack_rates_only_the_tokens_it_packed",
        "test_cli_manners.py::test_ctrl_c_during_pack_exits_130_and_prints_the_resume_command",
        "test_cli_manners.py::test_json_output_parses",
        "test_cli_tools.py::test_head_needs_a_tokenizer_it_can_find",
        "test_cli_tools.py::test_info_summarises_the_index",
        "test_cli_tools.py::test_verify_finds_a_flipped_byte_in_a_tokens_member",
        "test_cli_tools.py::test_verify_accepts_a_sound_dataset_in_both_modes",
        "test_cloud.py::test_every_scheme_reads_every_document_once_in_the_local_order",
        "test_cloud.py::test_faults_on_every_shard_change_nothing[s3-drop-2w]",
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
        "test_core_units.py::test_gather_tokens_joins_items_in_order_by_slices_or_by_index",
        "test_distributed.py::test_torchrun_elastic_three_ranks_to_two",
        "test_distributed.py::test_torchrun_exactly_once_without_equal_batches",
        "test_distributed.py::test_torchrun_killed_and_resumed_equals_uninterrupted",
        "test_distributed.py::test_torchrun_three_ranks_two_workers_each",
        "test_docs_run.py::test_every_code_block_of_the_page_runs",
        "test_global_state.py::test_importing_the_library_changes_no_environment_variable",
        "test_group_starts.py::test_a_consumer_whose_share_starts_late_reads_only_its_share",
        "test_group_starts.py::test_pack_lists_where_every_group_starts[docs]",
        "test_hf.py::test_trainer_two_ranks_each_document_once_and_resume_exact",
        "test_hostile_compressed.py::test_pack_count_and_loader_name_a_truncated_zst",
        "test_hostile_compressed.py::test_skip_keeps_every_document_decompressed_before_the_break_in_pack_count_and_loader",
        "test_hostile_shutdown.py::test_a_half_read_raw_loader_and_reader_exit_quietly",
        "test_integration_messages.py::test_model_inputs_of_a_mixture_batch_are_keywords_the_model_names[options0]",
        "test_integration_messages.py::test_multi_gpu_launch_on_cpus_names_accelerator_cpu_true",
        "test_integrity.py::test_a_huge_provenance_claim_is_refused_quickly_and_in_little_memory",
        "test_integrity.py::test_a_second_pack_into_a_running_packs_output_is_refused",
        "test_integrity.py::test_merge_copy_refuses_a_corrupt_shard",
        "test_lightning.py::test_mid_epoch_checkpoint_resumes_exactly",
        "test_loader_guarantees.py::test_equal_batches_in_every_batching_mode",
        "test_loader_guarantees.py::test_equal_batches_per_rank",
        "test_loader_guarantees.py::test_resample_is_deterministic_per_rank_and_worker",
        "test_mixture_raw.py::test_exactly_once_within_the_quota_across_ranks_and_workers",
        "test_mixture_raw.py::test_realized_quotas_and_raw_documents",
        "test_mixture_raw.py::test_resume_is_bit_exact_in_pack_mode",
        "test_mixture_raw.py::test_uint16_and_uint32_sources_widen_into_one_batch",
        "test_mixtures.py::test_exactly_once_within_the_quota_for_any_layout",
        "test_mixtures.py::test_refusals",
        "test_mixtures.py::test_repeats_and_subsets",
        "test_mixtures.py::test_resume_is_bit_exact_before_at_and_after_a_schedule_change[split]",
        "test_mixtures.py::test_stats_on_a_mixture_file",
        "test_mixtures.py::test_torchrun_three_ranks_two_workers_a_mixture_file",
        "test_nccl.py::test_the_same_collectives_over_gloo_at_world_size_1",
        "test_no_fork.py::test_nothing_we_started_outlives_the_loader[0-close]",
        "test_no_fork.py::test_nothing_we_started_outlives_the_loader[2-with]",
        "test_no_fork.py::test_remote_shards_without_workers_are_read_without_a_fork",
        "test_observe_export.py::test_hf_callback_adds_the_figures_to_each_log",
        "test_observe_export.py::test_lightning_callback_logs_through_the_trainers_logger",
        "test_observe_stages.py::test_a_packed_read_times_its_checks_and_decoding",
        "test_observe_stores.py::test_a_throttled_store_shows_in_the_wait_the_stages_and_the_store",
        "test_observe_wait.py::test_reduction_over_two_gloo_ranks_names_the_rank_that_waited",
        "test_hostile_shutdown.py::test_an_interpreter_that_exits_holding_live_iterators_prints_nothing",
        "test_observe_watchdog.py::test_a_stopped_worker_is_named_and_every_stack_logged",
        "test_observe_watchdog.py::test_close_after_watchdog_raise_leaves_no_stopped_worker",
        "test_observe_watchdog.py::test_watchdog_raise_stops_the_run_with_a_named_error",
        "test_observe_watchdog.py::test_without_workers_the_warning_holds_the_readers_own_stack",
        "test_offload.py::test_a_loader_without_workers_uses_it_and_one_with_workers_does_not",
        "test_offload.py::test_its_death_fails_its_spools_by_name_and_later_ones_download_here",
        "test_offload.py::test_shared_memory_is_recycled_once_nothing_writes_or_views_it",
        "test_pack_columnar.py::test_command_line_where_and_max_doc_bytes",
        "test_pack_columnar.py::test_corrupt_parquet_files",
        "test_pack_columnar.py::test_head_and_the_summary_show_rows",
        "test_pack_columnar.py::test_missing_and_non_text_columns",
        "test_pack_columnar.py::test_parquet_round_trip_equals_direct_tokenization",
        "test_pack_columnar.py::test_struct_field_and_where_give_the_same_documents_from_every_kind_of_input",
        "test_pack_determinism.py::test_docs_mode_output_is_independent_of_workers_and_chunking[variant0]",
        "test_pack_determinism.py::test_many_small_files_in_one_pack",
        "test_pack_determinism.py::test_packed_mode_output_is_independent_of_workers_and_chunking",
        "test_pack_determinism.py::test_paragraph_split_is_independent_of_chunking",
        "test_pack_determinism.py::test_skipped_input_is_reported_identically_whatever_the_chunking",
        "test_pack_errors.py::test_a_damaged_compressed_file_keeps_what_came_before_whatever_the_chunking",
        "test_pack_errors.py::test_non_empty_output_needs_overwrite",
        "test_pack_errors.py::test_progress_on_stderr_summary_on_stdout_and_quiet",
        "test_pack_inputs.py::test_stdin_needs_and_uses_input_format",
        "test_pack_limits.py::test_jsonl_long_lines_are_named_or_skipped_the_same_for_any_chunking",
        "test_pack_limits.py::test_paragraph_and_file_splits_pack_the_same_whatever_the_chunking",
        "test_pack_part.py::test_parts_merged_equal_a_local_pack",
        "test_pack_part.py::test_parts_of_input_files_merge_into_the_local_pack",
        "test_pack_remote_inputs.py::test_a_killed_pack_of_remote_parquet_resumes_byte_identically_unless_the_input_changed",
        "test_pack_remote_inputs.py::test_a_remote_object_cut_short_is_named_by_url_and_line",
        "test_pack_remote_inputs.py::test_arrow_files_and_raw_text_tars_over_http_equal_the_local_pack",
        "test_pack_remote_inputs.py::test_azure_jsonl_zst_and_parquet_equal_the_local_pack",
        "test_pack_remote_inputs.py::test_broken_connections_resume_and_give_the_same_dataset",
        "test_pack_remote_inputs.py::test_gcs_glob_of_parquet_equals_the_local_pack",
        "test_pack_remote_inputs.py::test_no_secret_reaches_the_index_or_a_message",
        "test_pack_remote_inputs.py::test_s3_glob_of_jsonl_zst_equals_the_local_pack",
        "test_pack_remote_inputs.py::test_tasks_over_one_remote_jsonl_file_split_it_by_byte_ranges",
        "test_pack_remote_inputs.py::test_tasks_over_one_remote_parquet_file_share_its_row_groups",
        "test_pack_remote_inputs.py::test_the_issues_example_hf_glob_packed_into_s3_by_the_cli",
        "test_pack_resume.py::test_docs_mode_resume_after_kill_equals_uninterrupted",
        "test_pack_resume.py::test_packed_mode_resume_after_kill_equals_uninterrupted",
        "test_pack_resume.py::test_parquet_resume_after_a_kill_at_a_random_point_equals_uninterrupted",
        "test_pack_resume.py::test_shards_then_lengths_then_index_last_then_journal_gone",
        "test_pack_resume.py::test_skip_mode_resume_counts_each_skip_once",
        "test_pack_roundtrip.py::test_bytes_per_token_at_most_2_1_with_default_options",
        "test_pack_roundtrip.py::test_llama_bos_once_by_default_and_eos_last",
        "test_pack_roundtrip.py::test_llama_no_bos_means_none",
        "test_pack_roundtrip.py::test_shard_size_and_shard_samples_are_limits",
        "test_pack_roundtrip.py::test_wiki_gpt2_ids_equal_direct_encode_plus_eos",
        "test_pack_tars.py::test_a_tar_from_stdin",
        "test_pack_tars.py::test_bad_samples_stop_the_pack_naming_the_sample",
        "test_pack_tars.py::test_tars_round_trip_with_keys",
        "test_pack_tasks.py::test_a_task_of_a_divided_file_resumes_byte_identically",
        "test_pack_tasks.py::test_command_line_takes_the_task_from_the_environment",
        "test_pack_tasks.py::test_eight_tasks_over_three_files_merge_to_the_single_task_pack",
        "test_pack_tasks.py::test_merge_moves_tasks_into_one_dataset",
        "test_pack_tasks.py::test_merge_on_s3_in_place",
        "test_pack_tasks.py::test_merge_refuses_what_is_not_one_pack",
        "test_pack_tasks.py::test_single_task_packs_with_empty_task",
        "test_pack_tasks.py::test_tasks_are_disjoint_and_together_hold_every_document",
        "test_parallel_agree.py::test_in_a_group_of_four_the_peer_that_died_is_named_not_its_living_peers",
        "test_parallel_example.py::test_tp_and_cp_layouts_train_each_dp_rank_on_the_same_batches",
        "test_parallel_layouts.py::test_a_peer_with_another_seed_fails_at_construction",
        "test_parallel_layouts.py::test_a_first_stage_that_fails_tells_its_middle_stage",
        "test_parallel_layouts.py::test_a_reader_that_fails_tells_its_receivers",
        "test_parallel_layouts.py::test_broadcast_over_http_reads_the_shard_bytes_of_the_dp_ranks_alone",
        "test_parallel_layouts.py::test_dp2_cp2_context_peers_hold_the_two_halves_of_one_batch",
        "test_parallel_layouts.py::test_dp2_tp2_cp2_on_eight_processes",
        "test_parallel_layouts.py::test_dp2_tp2_saved_mid_epoch_resumes_as_dp4_with_every_document_once",
        "test_parallel_layouts.py::test_dp2_tp2_tensor_peers_share_every_batch_and_dp_ranks_split_the_epoch",
        "test_parallel_layouts.py::test_pp2_dp2_first_stage_gets_inputs_last_gets_labels",
        "test_parallel_layouts.py::test_pp3_dp2_middle_stages_read_nothing_and_step_with_the_others",
        "test_parallel_layouts.py::test_replica_peers_agree_in_every_batching_mode_a_mixture_and_raw_text",
        "test_rank_pieces.py::test_ranks_differ_by_at_most_one_piece_and_each_ends_with_one_short_batch",
        "test_raw.py::test_bad_lines_are_named_or_skipped_and_counted",
        "test_raw.py::test_counts_give_equal_batches_and_len",
        "test_raw.py::test_elastic_resume_with_counts_three_ranks_to_two",
        "test_raw.py::test_exactly_once_across_ranks_and_workers[False-1-3]",
        "test_raw.py::test_remote_inputs_over_http_with_faults",
        "test_raw.py::test_resume_is_exact_and_does_not_tokenize_again",
        "test_raw.py::test_resume_without_counts_reads_again_and_is_exact",
        "test_raw.py::test_torchrun_two_ranks_raw_text_with_counts",
        "test_raw.py::test_units_divide_files_and_every_document_comes_once_with_its_tokens",
        "test_raw_pinned.py::test_a_changed_object_is_never_skipped_as_unreadable",
        "test_raw_pinned.py::test_a_counted_object_replaced_mid_epoch_is_refused_by_its_read",
        "test_raw_pinned.py::test_a_listing_and_an_answer_give_one_version",
        "test_raw_resume.py::test_resume_at_ninety_percent_tokenizes_only_what_is_left[bucket]",
        "test_raw_resume.py::test_resume_at_ninety_percent_tokenizes_only_what_is_left[concat]",
        "test_raw_tails.py::test_a_resume_among_the_held_and_the_merged_tails_equals_the_uninterrupted_epoch[bucket]",
        "test_raw_tails.py::test_a_resume_among_the_held_and_the_merged_tails_equals_the_uninterrupted_epoch[fixed]",
        "test_raw_tails.py::test_a_resume_among_the_held_and_the_merged_tails_equals_the_uninterrupted_epoch[pack]",
        "test_raw_tails.py::test_two_workers_end_a_raw_epoch_with_one_short_batch[bucket]",
        "test_raw_tails.py::test_two_workers_end_a_raw_epoch_with_one_short_batch[budget]",
        "test_raw_tails.py::test_two_workers_end_a_raw_epoch_with_one_short_batch[concat]",
        "test_raw_tails.py::test_two_workers_end_a_raw_epoch_with_one_short_batch[fixed]",
        "test_raw_tails.py::test_two_workers_end_a_raw_epoch_with_one_short_batch[pack]",
        "test_raw_versions.py::test_a_state_over_a_file_rewritten_at_the_same_size_is_refused[True]",
        "test_remote_loader.py::test_cli_reads_http_and_s3_datasets",
        "test_remote_loader.py::test_pack_to_s3_then_stream_exactly_once_over_ranks_and_workers",
        "test_remote_loader.py::test_s3_missing_root_bucket_or_shard_fails_fast",
        "test_remote_loader.py::test_skip_a_shard_that_keeps_failing_and_go_on[0]",
        "test_remote_pack.py::test_pack_killed_at_any_point_then_resumed_equals_an_uninterrupted_pack",
        "test_remote_pack.py::test_pack_killed_from_outside_mid_run_then_resumed",
        "test_remote_pack.py::test_pack_uploads_each_shard_as_it_completes_multipart_and_the_index_last",
        "test_remote_pack.py::test_resume_of_a_complete_s3_pack_is_refused",
        "test_resume.py::test_elastic_resume_yields_each_unconsumed_document_once",
        "test_resume.py::test_resume_equals_uninterrupted",
        "test_scale.py::test_a_format_3_and_a_format_4_part_merge_into_format_4_with_shards_npy",
        "test_scale.py::test_every_document_once_and_equal_batches[bucket]",
        "test_scale.py::test_every_document_once_and_equal_batches[budget]",
        "test_scale.py::test_every_document_once_and_equal_batches[budget_unaligned]",
        "test_scale.py::test_every_document_once_and_equal_batches[pack]",
        "test_scale.py::test_every_document_once_and_equal_batches[split]",
        "test_scale.py::test_resume_mid_epoch_on_the_scale_dataset[budget]",
        "test_scale.py::test_resume_mid_epoch_on_the_scale_dataset[pack]",
        "test_shared_spool.py::test_an_epoch_of_one_shard_gets_it_once_and_yields_what_ranged_reads_do",
        "test_shared_spool.py::test_epochs_of_one_small_shard_download_it_once_each_after_the_first",
        "test_shared_spool.py::test_every_epochs_blocks_share_the_spool_they_read",
        "test_shuffle_ddp.py::test_one_shard_under_ddp_reshuffles_ranks_and_resumes_exactly",
        "test_online_mixing_example.py::test_weights_change_and_a_resumed_run_equals_the_uninterrupted_one",
        "test_skip_blocks.py::test_a_resume_after_a_lost_shard_equals_the_uninterrupted_run[budget-True]",
        "test_skip_blocks.py::test_a_resume_after_a_lost_shard_equals_the_uninterrupted_run[concat-False]",
        "test_skip_blocks.py::test_a_resume_after_a_lost_shard_equals_the_uninterrupted_run[concat-True]",
        "test_skip_blocks.py::test_a_resume_after_a_lost_shard_equals_the_uninterrupted_run[fixed-True]",
        "test_skip_blocks.py::test_a_resume_after_a_lost_shard_equals_the_uninterrupted_run[pack-False]",
        "test_skip_blocks.py::test_a_resume_after_a_lost_shard_equals_the_uninterrupted_run[pack-True]",
        "test_state.py::test_a_mutated_state_is_refused_or_resumes_exactly",
        "test_steering_ahead.py::test_a_change_made_ahead_is_the_change_made_at_its_step[12-0-exclude documents]",
        "test_steering_ahead.py::test_a_change_made_ahead_is_the_change_made_at_its_step[12-0-weights]",
        "test_steering_ahead.py::test_a_change_made_ahead_is_the_change_made_at_its_step[12-2-exclude a source]",
        "test_steering_ahead.py::test_a_change_made_ahead_is_the_change_made_at_its_step[12-2-weights]",
        "test_steering_ahead.py::test_a_change_made_ahead_is_the_change_made_at_its_step[35-0-exclude a source]",
        "test_steering_ahead.py::test_a_change_made_ahead_is_the_change_made_at_its_step[35-0-exclude documents]",
        "test_steering_ahead.py::test_a_change_made_ahead_is_the_change_made_at_its_step[35-2-exclude a source]",
        "test_steering_ahead.py::test_a_change_made_ahead_is_the_change_made_at_its_step[35-2-exclude documents]",
        "test_steering_ahead.py::test_a_change_made_ahead_is_the_change_made_at_its_step[35-2-weights]",
        "test_steering_ahead.py::test_resume_between_the_call_and_its_step_equals_uninterrupted[3-0]",
        "test_steering_ahead.py::test_resume_between_the_call_and_its_step_equals_uninterrupted[3-2]",
        "test_steering_ahead.py::test_resume_between_the_call_and_its_step_equals_uninterrupted[4-0]",
        "test_steering_ahead.py::test_resume_between_the_call_and_its_step_equals_uninterrupted[7-0]",
        "test_steering_ahead.py::test_resume_between_the_call_and_its_step_equals_uninterrupted[7-2]",
        "test_steering_ahead.py::test_resume_between_the_call_and_its_step_equals_uninterrupted[11-2]",
        "test_steering_ahead.py::test_resume_between_the_call_and_its_step_equals_uninterrupted[12-0]",
        "test_steering_ahead.py::test_resume_between_the_call_and_its_step_equals_uninterrupted[15-0]",
        "test_steering_ahead.py::test_resume_between_the_call_and_its_step_equals_uninterrupted[15-2]",
        "test_steering_plans.py::test_stats_and_explain_take_a_states_changes",
        "test_steering_raw.py::test_a_raw_unit_excluded_ahead_is_the_unit_excluded_at_its_step",
        "test_steering_raw.py::test_resume_around_a_skip_and_an_exclusion_of_the_raw_source_equals_uninterrupted[12]",
        "test_steering_raw.py::test_resume_around_a_skip_and_an_exclusion_of_the_raw_source_equals_uninterrupted[2]",
        "test_steering_ranks.py::test_two_ranks_take_the_same_change_and_refuse_a_different_one",
        "test_storage.py::test_cache_concurrent_processes_download_once",
        "test_storage.py::test_output_s3_with_multipart_upload",
        "test_storage.py::test_s3_worker_forked_after_prepare_workers_reads_with_the_prepared_client[False]",
        "test_tokenizer_carried.py::test_head_and_the_loader_decode_with_the_carried_tokenizer",
        "test_tokenizer_carried.py::test_pack_stores_the_tokenizer_and_verify_checks_it",
        "test_torchtitan.py::test_dp2_tp2_and_dp2_cp2_checkpoint_through_torchtitan_and_resume_exactly_also_as_dp4",
        "test_train_ddp.py::test_attention_stays_within_documents",
        "test_train_ddp.py::test_every_rank_takes_the_steps_on_disjoint_rows",
        "test_train_ddp.py::test_resume_equals_uninterrupted",
        "test_transport.py::test_abandoned_epochs_do_not_stall_the_next[False]",
        "test_transport.py::test_workers_send_the_batches_one_process_makes[spawn]",
        "test_where.py::test_json_and_arrow_agree",
    }
)


def pytest_collection_modifyitems(config, items):
    seen = set()
    files = set()
    for item in items:
        path = item.nodeid.split("::", 1)[0].removeprefix("tests/")
        files.add(path)
        for name in (f"{path}::{item.originalname}", f"{path}::{item.name}"):
            if name in SLOW_TESTS:
                seen.add(name)
                item.add_marker(pytest.mark.slow)
    narrowed = config.option.keyword or config.option.markexpr or any("::" in a for a in config.args)
    missing = sorted(n for n in SLOW_TESTS - seen if n.split("::", 1)[0] in files)
    if missing and not narrowed:
        raise pytest.UsageError(f"conftest.SLOW_TESTS names tests that do not exist: {', '.join(missing)}")
