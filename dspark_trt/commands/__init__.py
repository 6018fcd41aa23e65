"""What the `dspark-trt` commands do beyond one library call (cli.py stays a thin shell over these)."""
