"""Every Triton kernel and our C++ CPU kernels, as plain tensor functions; imports nothing of gpt-fast outside this
package."""
