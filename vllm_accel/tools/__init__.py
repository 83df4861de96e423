"""Command-line tools of vllm-accel (the ``vllm-accel`` console script): not
imported by the plugin itself."""
